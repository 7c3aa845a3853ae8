"""The per client x server summary of a run's records, and the table printed from it."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any


def _interrupted(record: dict[str, Any]) -> bool:
    return "interrupted" in (record.get("upstream_error") or "")


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts, errors, tokens and TTFT of one client x server run's requests."""
    model_calls = [
        r for r in records if r["api"] in ("anthropic", "responses", "chat", "completions")
    ]
    ttfts = [r["ttft_s"] for r in model_calls if r["ttft_s"] is not None and r["status"] < 300]
    errors = Counter(
        (r["status"], f"{r['method']} {r['path'].split('?')[0]}", r.get("error", ""))
        for r in records
        if not 200 <= r["status"] < 300 and not _interrupted(r)
    )
    prompts = [r["prompt_tokens"] for r in records if r["prompt_tokens"] is not None]
    cached = [r["cached_tokens"] for r in records if r["cached_tokens"] is not None]
    diffs = [r["prompt_diff"] for r in records if "prompt_diff" in r]
    return {
        "requests": len(records),
        "model_requests": len(model_calls),
        "ok": sum(200 <= r["status"] < 300 for r in records),
        "non_2xx": [
            {"status": s, "route": route, "error": e, "count": n}
            for (s, route, e), n in errors.most_common()
        ],
        "paths": dict(Counter(f"{r['method']} {r['path'].split('?')[0]}" for r in records)),
        "prompt_tokens_sum": sum(prompts) if prompts else None,
        "prompt_tokens_max": max(prompts) if prompts else None,
        "cached_tokens_sum": sum(cached) if cached else None,
        "ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "ttft_max_s": max(ttfts) if ttfts else None,
        "interrupted": sum(_interrupted(r) for r in records),
        "turns_extending_prefix": sum(d["extends"] for d in diffs),
        "turns_diverging": sum(not d["extends"] for d in diffs),
    }


def _num(value: float | int | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def table(results: list[dict[str, Any]]) -> str:
    """A markdown table, one row per client x server."""
    head = (
        "| client | server | requests | 2xx | non-2xx (status: first error) | prompt tok "
        "(sum / max) | cached tok | TTFT med / max (s) | session (s) | exit |"
    )
    rows = [head, "|" + "---|" * 10]
    for res in results:
        s = res.get("summary") or {}
        errs = "; ".join(
            f"{e['count']}x {e['status']} {e['route']}: {e['error'][:90]}"
            for e in s.get("non_2xx", [])
        )
        if s.get("interrupted"):
            errs = f"{errs}; " * bool(errs) + f"{s['interrupted']} cut off (client left)"
        if res.get("skipped"):
            errs = f"not run: {res['skipped']}"
        exit_ = "timeout" if res.get("timed_out") else _num(res.get("exit_code"), "{}")
        rows.append(
            f"| {res['client']} | {res['server']} | {s.get('requests', 0)} | {s.get('ok', 0)} "
            f"| {errs or '-'} | {_num(s.get('prompt_tokens_sum'), '{}')} / "
            f"{_num(s.get('prompt_tokens_max'), '{}')} | {_num(s.get('cached_tokens_sum'), '{}')} "
            f"| {_num(s.get('ttft_median_s'))} / {_num(s.get('ttft_max_s'))} "
            f"| {_num(res.get('duration_s'), '{:.0f}')} | {exit_} |"
        )
    return "\n".join(rows)
