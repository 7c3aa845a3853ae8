"""Single-stream decode tok/s per setting of the kernels' thread pool, in one engine process.

    PYTHONPATH=. python bench/pool_settings.py 1,2,50 2,2,50 2,2,200 [--rounds 5] [--tokens 64]

Each SETTING is ``threads,claim_div,spin_us`` (qmm.h; bench-only knobs, not user settings).
The embedded default model is loaded once; every round runs one greedy request of
``--tokens`` tokens per setting, the settings interleaved round by round, so a change of
the machine's load hits them all. Prints the best and median decode tok/s per setting and
every round's number (on a shared machine the spread between rounds is the load's).
"""

from __future__ import annotations

import argparse
import os

from mlxserve.cli.bench.workload import make_engine, make_prompts, timed_generate
from mlxserve.cpu import kernels as cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("settings", nargs="+", help="threads,claim_div,spin_us")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    settings = [tuple(int(v) for v in s.split(",")) for s in args.settings]
    if not cpu.available():
        raise SystemExit(cpu.status())
    engine = make_engine(None)
    module = cpu.module()
    tok = engine.tokenizer
    timed_generate(engine, make_prompts(tok, 2, 32, start=900), 8)  # warm up
    results: dict[tuple[int, ...], list[float]] = {s: [] for s in settings}
    start_load = os.getloadavg()[0]
    for r in range(args.rounds):
        for s in settings:
            threads, claim_div, spin_us = s
            module.set_threads(threads)
            module.set_claim_div(claim_div)
            module.set_spin_us(spin_us)
            run = timed_generate(engine, make_prompts(tok, 1, 32, start=100 * r), args.tokens)
            results[s].append((args.tokens - 1) / (run["wall_s"] - run["first_token_s"]))
    module.set_threads(0)
    print(f"load average {start_load:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    for s, runs in results.items():
        median = sorted(runs)[len(runs) // 2]
        cells = " ".join(f"{v:.1f}" for v in runs)
        print(
            f"threads {s[0]} claim-div {s[1]} spin {s[2]} us: best {max(runs):.1f} "
            f"median {median:.1f} tok/s ({cells})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
