"""Tables, goal ratios and the PNG chart of a bench/run.py results dict."""

from __future__ import annotations

import math
from pathlib import Path

OFFLINE_KEYS = [
    ("decode_tok_s", "single-stream decode tok/s"),
    ("prefill_tok_s", "prefill tok/s"),
    ("batch8_tok_s", "batch 8 output tok/s"),
    ("batch32_tok_s", "batch 32 output tok/s"),
]
SERVING_KEYS = [
    ("output_tok_s", "output tok/s"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("tpot_p50_ms", "TPOT p50 ms"),
    ("itl_p50_ms", "ITL p50 ms"),
    ("itl_p99_ms", "ITL p99 ms"),
    ("cpu_ms_per_token", "server CPU ms per output token"),
]

# bench/serving.py under_load(): stream ITLs while the arrivals are served, their TTFT.
LOAD_KEYS = [
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_p99_over_p50",
    "itl_max_ms",
    "baseline_itl_p50_ms",
    "stream_tok_s",
    "arrival_ttft_p50_ms",
    "arrival_ttft_max_ms",
    "window_s",
    "stream_restarts",
]


def _fmt(v: object) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def _table(title: str, header: list[str], rows: list[list[object]]) -> None:
    print(f"\n{title}")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(_fmt(x) for x in row) + " |")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def goals(results: dict) -> list[tuple[str, float | None, str, bool | None]]:
    """(goal, measured ratio, target, met)."""
    off = results.get("offline", {})
    srv = results.get("serving", {})
    mixed = results.get("mixed", {})
    prefix = results.get("prefix", {})
    ours = off.get("mlxserve", {})
    out = []

    def add(name: str, value: float | None, target: float, higher: bool = True) -> None:
        met = None if value is None else (value >= target if higher else value <= target)
        out.append((name, value, (">= " if higher else "<= ") + f"{target:g}", met))

    add(
        "decode: mlxserve / mlx-lm",
        _ratio(ours.get("decode_tok_s"), off.get("mlx-lm", {}).get("decode_tok_s")),
        1.2,
    )
    add(
        "decode: mlxserve / mlx-lm+openblas (f32)",
        _ratio(ours.get("decode_tok_s"), off.get("mlx-lm+openblas", {}).get("decode_tok_s")),
        1.2,
    )
    c32 = lambda e: srv.get(e, {}).get("32", {}).get("output_tok_s")  # noqa: E731
    add("32 concurrent: mlxserve / mlx-lm server", _ratio(c32("mlxserve"), c32("mlx-lm")), 2.0)
    add(
        "batch 32: LLM.generate / batch_generate",
        _ratio(ours.get("batch32_tok_s"), off.get("mlx-lm", {}).get("batch32_tok_s")),
        1.5,
    )
    add(
        "mixed: mlxserve ITL p99 / p50",
        mixed.get("mlxserve", {}).get("itl_p99_over_p50"),
        3.0,
        False,
    )
    peak = lambda e: results.get("rss", {}).get("serving", {}).get(e, {}).get("peak_mib")  # noqa: E731
    add(
        "peak RSS (serving): mlxserve / llama-server",
        _ratio(peak("mlxserve"), peak("llama.cpp")),
        1.3,
        False,
    )
    on = prefix.get("mlxserve", {}).get("ttft_p50_ms")
    off_ = prefix.get("mlxserve (no prefix caching)", {}).get("ttft_p50_ms")
    add("shared prefix: TTFT off / on", _ratio(off_, on), 5.0)
    return out


def print_report(results: dict) -> None:
    d = results.get("device", {})
    print(
        f"\nmodel {results.get('model')}; {d.get('platform')}, {d.get('cpu_count')} cores, "
        f"mlx {d.get('mlx')} on {d.get('device')}; {d.get('blas')}"
    )
    off = results.get("offline", {})
    if off:
        engines = list(off)
        rows = [[label] + [off[e].get(k) for e in engines] for k, label in OFFLINE_KEYS]
        _table("offline", ["metric", *engines], rows)
    srv = results.get("serving", {})
    if srv:
        engines = list(srv)
        levels = sorted({c for e in engines for c in srv[e]}, key=int)
        rows = []
        for c in levels:
            for k, label in SERVING_KEYS:
                rows.append([f"c={c} {label}"] + [srv[e].get(c, {}).get(k) for e in engines])
        _table("serving (streaming /v1/completions, greedy)", ["metric", *engines], rows)
    titles = {
        "mixed": "mixed (8 streams keep decoding while two long prompts arrive)",
        "busy": "busy (streams keep decoding while 8 short prompts arrive)",
    }
    for section, title in titles.items():
        res = results.get(section, {})
        if res:
            _table(title, ["metric", *res], [[k] + [res[e].get(k) for e in res] for k in LOAD_KEYS])
    prefix = results.get("prefix", {})
    if prefix:
        keys = ["first_ttft_ms", "ttft_p50_ms", "ttft_mean_ms"]
        _table(
            "shared prefix (long system prompt + short question)",
            ["metric", *prefix],
            [[k] + [prefix[e].get(k) for e in prefix] for k in keys],
        )
    rss = results.get("rss", {})
    if rss:
        engines = list(dict.fromkeys(e for section in rss.values() for e in section))
        rows = [
            [f"{section} {kind}"] + [rss[section].get(e, {}).get(f"{kind}_mib") for e in engines]
            for section in rss
            for kind in ("peak", "ready")
        ]
        _table(
            "server resident memory, MiB (peak over the section; when ready)",
            ["section", *engines],
            rows,
        )
    mem = results.get("memory")
    if mem:
        print(
            f"\nmemory: KV {mem['kv_bytes_per_token']} bytes/token ({mem['kv_dtype']}); budget "
            f"{mem['budget_bytes'] // 2**20} MiB = {mem['budget_tokens']} tokens; {mem['workload']}"
        )
        for label in ("distinct", "shared_1024_prefix"):
            print(
                f"  {label}: requests that fit: mlxserve {mem[label]['mlxserve']}, "
                f"mlx-lm {mem[label]['mlx_lm']}"
            )
        if "mlx_lm_measured_kv_bytes" in mem:
            print(f"  mlx-lm measured KV bytes by prompt length: {mem['mlx_lm_measured_kv_bytes']}")
    rows = [
        [
            name,
            None if value is None else f"{value:.2f}",
            target,
            {True: "met", False: "MISSED", None: "-"}[met],
        ]
        for name, value, target, met in goals(results)
    ]
    _table("goals", ["ratio", "measured", "target", ""], rows)
    if "llama.cpp" in off and "mlxserve" in off:
        rows = [
            [label, _ratio(off["mlxserve"].get(k), off["llama.cpp"].get(k))]
            for k, label in OFFLINE_KEYS
        ]
        _table("distance to llama.cpp (mlxserve / llama.cpp)", ["metric", "ratio"], rows)


def write_chart(results: dict, path: Path) -> None:
    """Throughput vs concurrency, TTFT and ITL percentiles per engine, offline bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    d = results.get("device", {})
    fig.suptitle(
        f"{results.get('model')} - {d.get('platform')} - mlx {d.get('mlx')} on {d.get('device')}"
    )
    srv = results.get("serving", {})
    ax = axes[0][0]
    for e, levels in srv.items():
        cs = sorted(levels, key=int)
        ax.plot([int(c) for c in cs], [levels[c]["output_tok_s"] for c in cs], marker="o", label=e)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="concurrent clients",
        ylabel="output tok/s",
        title="serving throughput",
    )
    ax.legend()
    for ax, metric, title in ((axes[0][1], "ttft", "TTFT"), (axes[1][0], "itl", "ITL")):
        labels, p50, p99 = [], [], []
        for e, levels in srv.items():
            for c in sorted(levels, key=int):
                labels.append(f"{e}\nc={c}")
                p50.append(levels[c][f"{metric}_p50_ms"])
                p99.append(levels[c][f"{metric}_p99_ms"])
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set(yscale="log", ylabel="ms", title=f"{title} percentiles")
        ax.legend()
    ax = axes[1][1]
    off = results.get("offline", {})
    engines = list(off)
    for j, e in enumerate(engines):
        vals = [off[e].get(k) or 0 for k, _ in OFFLINE_KEYS]
        ax.bar(
            [i + j * 0.8 / max(len(engines), 1) for i in range(len(OFFLINE_KEYS))],
            vals,
            0.8 / max(len(engines), 1),
            label=e,
        )
    ax.set_xticks(
        [i + 0.3 for i in range(len(OFFLINE_KEYS))], ["decode", "prefill", "batch 8", "batch 32"]
    )
    ax.set(yscale="log", ylabel="tok/s", title="offline")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
