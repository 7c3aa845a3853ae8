"""The one report of every measuring `mlxserve bench` sub-command: tables, goal ratios,
results.json and a PNG chart.

A results dict holds the sections that were run, each keyed by engine: ``offline``
(`latency`, `throughput`, the quick check, `peers`), ``profile`` (the step profile),
``serving``, ``mixed``, ``busy``, ``prefix``, ``rss`` (`serve`, `peers`) and ``memory``
(`peers`); a section that was not run is absent, and so are its tables and panels.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

LATENCY_KEYS = [
    ("decode_tok_s", "single-stream decode tok/s"),
    ("prefill_tok_s", "prefill tok/s"),
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

# serving.under_load(): stream ITLs while the arrivals are served, their TTFT.
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


def offline_keys(off: dict[str, dict]) -> list[tuple[str, str]]:
    """(key, label) of the offline numbers any engine has: latency first, then batches."""
    have = {k for numbers in off.values() for k in numbers}
    batches = sorted(int(k[5:-6]) for k in have if k.startswith("batch") and k.endswith("_tok_s"))
    keys = [(k, label) for k, label in LATENCY_KEYS if k in have]
    return keys + [(f"batch{n}_tok_s", f"batch {n} output tok/s") for n in batches]


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
        rows = [[label] + [off[e].get(k) for e in engines] for k, label in offline_keys(off)]
        _table("offline", ["metric", *engines], rows)
    profile = {e: p for e, p in (results.get("profile") or {}).items() if p}
    if profile:
        keys = ["batch", "step_ms", "host_ms", "wait_ms"]
        rows = [[k] + [profile[e].get(k) for e in profile] for k in keys]
        rows.append(["host_share"] + [f"{profile[e]['host_share']:.0%}" for e in profile])
        _table(
            "step profile (decode-only steps: host = Python, wait = blocked in MLX)",
            ["metric", *profile],
            rows,
        )
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
        [name, f"{value:.2f}", target, "met" if met else "MISSED"]
        for name, value, target, met in goals(results)
        if value is not None  # a goal whose engines were not both run
    ]
    if rows:
        _table("goals", ["ratio", "measured", "target", ""], rows)
    if "llama.cpp" in off and "mlxserve" in off:
        rows = [
            [label, _ratio(off["mlxserve"].get(k), off["llama.cpp"].get(k))]
            for k, label in offline_keys(off)
        ]
        _table("distance to llama.cpp (mlxserve / llama.cpp)", ["metric", "ratio"], rows)


def publish(results: dict, out_dir: Path | None) -> None:
    """Print the report; with ``out_dir``, also write results.json and chart.png there."""
    print_report(results)
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    if hasattr(os, "getloadavg"):
        results.setdefault("conditions", {})["loadavg_end"] = os.getloadavg()
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    wrote = [out_dir / "results.json"]
    try:
        if write_chart(results, out_dir / "chart.png"):
            wrote.append(out_dir / "chart.png")
    except ImportError:
        print("\nno chart: it needs matplotlib (pip install -e '.[bench]' in the clone)")
    print(f"\nwrote {' and '.join(str(p) for p in wrote)}")


def write_chart(results: dict, path: Path) -> bool:
    """The panels the results have data for: serving throughput vs concurrency, TTFT and
    ITL percentiles per engine and concurrency, offline tok/s bars per engine. False when
    there is nothing to draw (no file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    srv = results.get("serving", {})
    off = results.get("offline", {})
    panels = ["throughput", "ttft", "itl"] if srv else []
    panels += ["offline"] if off else []
    if not panels:
        return False
    cols = min(len(panels), 2)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.5 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    d = results.get("device", {})
    fig.suptitle(
        f"{results.get('model')} - {d.get('platform')} - mlx {d.get('mlx')} on {d.get('device')}"
    )
    for ax, panel in zip(flat, panels, strict=False):
        if panel == "throughput":
            for e, levels in srv.items():
                cs = sorted(levels, key=int)
                ys = [levels[c]["output_tok_s"] for c in cs]
                ax.plot([int(c) for c in cs], ys, marker="o", label=e)
            ax.set(
                xscale="log",
                yscale="log",
                xlabel="concurrent clients",
                ylabel="output tok/s",
                title="serving throughput",
            )
            ax.legend()
        elif panel in ("ttft", "itl"):
            labels, p50, p99 = [], [], []
            for e, levels in srv.items():
                for c in sorted(levels, key=int):
                    labels.append(f"{e}\nc={c}")
                    p50.append(levels[c][f"{panel}_p50_ms"])
                    p99.append(levels[c][f"{panel}_p99_ms"])
            x = range(len(labels))
            ax.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
            ax.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
            ax.set_xticks(list(x), labels, fontsize=7)
            ax.set(yscale="log", ylabel="ms", title=f"{panel.upper()} percentiles")
            ax.legend()
        else:
            keys = offline_keys(off)
            engines = list(off)
            width = 0.8 / max(len(engines), 1)
            for j, e in enumerate(engines):
                vals = [off[e].get(k) or 0 for k, _ in keys]
                ax.bar([i + j * width for i in range(len(keys))], vals, width, label=e)
            short = [label.replace(" output tok/s", "").replace(" tok/s", "") for _, label in keys]
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))], short, fontsize=8)
            ax.set(yscale="log", ylabel="tok/s", title="offline")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
