"""bench/gemv_floor.c built as the extension builds the kernels, for one or more source trees.

    PYTHONPATH=. python bench/gemv_floor.py [--csrc DIR ...] [--runs 2] [--rounds 10]
        [SETTING ...]

Each kernel source goes through the compiler with mlxserve/cpu/build.py's flags (-O3 and
the per-file instruction-set flags: a harness built with other flags measures other code),
then gemv_floor.c is linked against it, once per ``--csrc`` (default: this tree's
mlxserve/csrc; give main's and a branch's for an A/B), and the binaries run alternately
``--runs`` times. SETTINGs are passed on: ``threads,claim_div,spin_us`` (see the C file).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlxserve.cpu.build import ARM_FLAGS, COMMON_FLAGS, SOURCES, X86_FLAGS

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent / "mlxserve" / "csrc"


def build(csrc: Path, out: Path) -> Path:
    """The harness against the kernels in ``csrc``, compiled with the extension's flags."""
    machine = platform.machine().lower()
    isa_flags = X86_FLAGS if machine in ("x86_64", "amd64") else ARM_FLAGS
    out.mkdir(parents=True, exist_ok=True)
    jobs = []
    for src in SOURCES:
        flags = isa_flags.get(src, []) + COMMON_FLAGS.get(src, [])
        obj = out / (src + ".o")
        jobs.append(["cc", "-O3", "-std=gnu11", *flags, "-c", str(csrc / src), "-o", str(obj)])
    with ThreadPoolExecutor() as pool:
        list(pool.map(lambda cmd: subprocess.run(cmd, check=True), jobs))
    exe = out / "gemv_floor"
    objects = [str(out / (src + ".o")) for src in SOURCES]
    cmd = ["cc", "-O2", "-std=gnu11", "-I", str(csrc), str(HERE / "gemv_floor.c"), *objects]
    subprocess.run([*cmd, "-lm", "-lpthread", "-o", str(exe)], check=True)
    return exe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--csrc", type=Path, action="append", help="kernel sources (repeatable)")
    ap.add_argument("--runs", type=int, default=2, help="alternating runs of every build")
    ap.add_argument("--rounds", type=int, default=10, help="best of, inside each run")
    ap.add_argument("settings", nargs="*", help="threads,claim_div,spin_us")
    args = ap.parse_args(argv)
    trees = args.csrc or [CSRC]
    with tempfile.TemporaryDirectory() as tmp:
        exes = [build(tree.resolve(), Path(tmp) / str(i)) for i, tree in enumerate(trees)]
        for run in range(args.runs):
            for tree, exe in zip(trees, exes, strict=True):
                load = os.getloadavg()[0]
                print(f"--- run {run + 1}, {tree} (load {load:.2f})", flush=True)
                subprocess.run([str(exe), str(args.rounds), *args.settings], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
