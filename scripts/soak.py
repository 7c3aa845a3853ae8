"""Soak `mlxserve serve` on localhost: many clients, mixed APIs, disconnects, then checks.

The long form of tests/test_soak.py (same code, tests/soak_harness.py), e.g.

    PYTHONPATH=. python scripts/soak.py --clients 64 --duration 240 --out soak.json

starts `mlxserve serve [MODEL]` on a free 127.0.0.1 port, warms it up, loads it, checks
it (see tests/soak_harness.py), prints the figures, writes the full report as JSON to
--out, and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.server_harness import start_server  # noqa: E402
from tests.soak_harness import SoakConfig, run_soak  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Parse flags, start the server, soak it, report; 0 when every check passed."""
    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="MODEL (default: the embedded one)")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (default: 64)")
    p.add_argument("--duration", type=float, default=240.0, help="seconds of load (default: 240)")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of warm-up (default: 30)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--disconnect-rate", type=float, default=d.disconnect_rate)
    p.add_argument("--shared-prefix-rate", type=float, default=d.shared_prefix_rate)
    p.add_argument("--rss-bound-mib", type=float, default=d.rss_bound_mib)
    p.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout,
        help=f"seconds a call may wait for its next bytes (default: {d.request_timeout:g})",
    )
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    p.add_argument(
        "--server-arg", action="append", default=[], help="extra `serve` flag (repeatable)"
    )
    args = p.parse_args(argv)
    config = SoakConfig(
        clients=args.clients,
        duration=args.duration,
        warmup=args.warmup,
        seed=args.seed,
        disconnect_rate=args.disconnect_rate,
        shared_prefix_rate=args.shared_prefix_rate,
        rss_bound_mib=args.rss_bound_mib,
        request_timeout=args.request_timeout,
    )
    log_path = Path(tempfile.mkdtemp(prefix="mlxserve-soak-")) / "server.log"
    serve_args = ([args.model] if args.model else []) + args.server_arg + ["--disable-log-stats"]
    server = start_server(serve_args, log_path)
    print(f"[soak] server pid {server.proc.pid} on {server.url}, log {log_path}", flush=True)
    try:
        report = run_soak(server.url, server.proc.pid, config, server_log=log_path)
    finally:
        server.stop()
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"[soak] report written to {args.out}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
