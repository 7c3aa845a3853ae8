"""`mlxserve bench agents` (`python -m bench.agents` in a checkout): each coding-agent client x
each server, one short session.

For every server (mlxserve, llama-server), started alone on 127.0.0.1, and every client,
one after another: a fresh git repo holding a small bug, a fresh HOME, a logging proxy
in front of the server, the client run headless with a time limit, everything killed at
the end. Prints one table row per client x server and writes OUT/results.json, and per
run OUT/<client>-<server>/{requests,bodies}.jsonl and the client's own output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.agents import clients, report, servers
from bench.agents.proxy import NetCatcher, ProxyServer, Recorder
from mlxserve.cli.bench.common import cache_dir
from mlxserve.cli.bench.serving import Server

PROMPT = (
    "The test in test_calc.py fails because of a bug in calc.py. Fix the bug in calc.py, "
    "then run `python3 test_calc.py` to check that the tests pass."
)
# A session: the task, then follow-ups that continue the same conversation (a small model
# often answers in one request, and a session of one request shows nothing of the next).
TURNS = [
    PROMPT,
    "Run `python3 test_calc.py` now and tell me whether it passes.",
    "In one sentence: what did you change in calc.py, if anything?",
]
CALC = '''"""Tiny arithmetic helpers."""


def add(a, b):
    return a - b


def mul(a, b):
    return a * b
'''
TEST_CALC = """import unittest

from calc import add, mul


class CalcTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_mul(self):
        self.assertEqual(mul(2, 3), 6)


if __name__ == "__main__":
    unittest.main()
"""
GIT = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]


def make_repo(repo: Path) -> None:
    """A git repo with calc.py (add subtracts) and its failing test, committed."""
    repo.mkdir(parents=True)
    (repo / "calc.py").write_text(CALC)
    (repo / "test_calc.py").write_text(TEST_CALC)
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "calc with a bug"]):
        subprocess.run(GIT + cmd, cwd=repo, check=True, timeout=60, capture_output=True)


def run_client(
    name: str,
    exe: Path,
    server: Server,
    catcher: NetCatcher,
    out: Path,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One session of client ``name`` against ``server`` through a logging proxy."""
    label = f"{name}-{server.spec.name}"
    run_dir = out / label
    home, repo = run_dir / "home", run_dir / "repo"
    home.mkdir(parents=True)
    make_repo(repo)
    recorder = Recorder(run_dir, name, server.spec.name)
    result: dict[str, Any] = {"client": name, "server": server.spec.name}
    catcher.label = label
    with ProxyServer(server.url, recorder, read_timeout_s=args.time_limit) as proxy:
        env = clients.base_env(home, catcher.url, [exe.parent, Path(sys.executable).parent])
        result["turns"] = []
        t0 = time.monotonic()
        for turn, prompt in enumerate(TURNS[: args.turns]):
            left = args.time_limit - (time.monotonic() - t0)
            if left <= 0:
                break
            session = clients.Session(
                proxy.url,
                prompt,
                env,
                args.max_turns,
                args.max_output_tokens,
                args.max_model_len,
                resume=turn > 0,
            )
            run = clients.MAKE_RUN[name](exe, session)
            for path, text in run.files.items():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            print(
                f"[agents] {label} turn {turn + 1}: {Path(run.argv[0]).name} {run.argv[1]} ... "
                f"({left:.0f} s left)"
            )
            outcome = {"argv": run.argv, **run_turn(run, repo, run_dir, turn, left)}
            result["turns"].append(outcome)
            if outcome["timed_out"]:
                break  # the session's time is up
            # A non-zero exit goes on: a client exits 1 when the model's answer hit its
            # output limit (Claude Code, Codex), and the conversation continues from there.
        result["duration_s"] = time.monotonic() - t0
        last = result["turns"][-1] if result["turns"] else {}
        result["argv"] = last.get("argv", [])
        result["exit_code"] = last.get("exit_code")
        result["timed_out"] = last.get("timed_out", True)
    test = subprocess.run(["python3", "test_calc.py"], cwd=repo, capture_output=True, timeout=60)
    result["task_solved"] = test.returncode == 0  # not expected of a 135M model
    result["summary"] = report.summarize(recorder.records)
    result["net_attempts"] = [a for a in catcher.attempts if a["client"] == label]
    turns = len(result["turns"])
    err = run_dir / ("client.err" if turns <= 1 else f"client-turn{turns}.err")
    result["client_stderr_tail"] = err.read_text(errors="replace")[-1500:] if err.exists() else ""
    return result


def run_turn(run: clients.Run, repo: Path, run_dir: Path, turn: int, limit: float) -> dict:
    """One client invocation in the session's repo: its exit, or a timeout, and its time."""
    suffix = "" if turn == 0 else f"-turn{turn + 1}"
    t0 = time.monotonic()
    with (
        (run_dir / f"client{suffix}.out").open("w") as stdout,
        (run_dir / f"client{suffix}.err").open("w") as err,
    ):
        proc = subprocess.Popen(
            run.argv,
            cwd=repo,
            env=run.env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=err,
            start_new_session=True,  # its tools' children die with it
        )
        try:
            outcome = {"exit_code": proc.wait(timeout=limit), "timed_out": False}
        except subprocess.TimeoutExpired:
            outcome = {"exit_code": None, "timed_out": True}
        finally:
            kill_group(proc)
    return {**outcome, "duration_s": time.monotonic() - t0}


def kill_group(proc: subprocess.Popen) -> None:
    """End a client and everything it started: SIGTERM, then SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers left in the group
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def warm_up(url: str, timeout_s: float = 900.0) -> float:
    """One short chat request before the sessions, so a server's first-use costs (kernel
    and graph builds) are not charged to the first client; its time."""
    body = {
        "model": servers.SERVED_NAME,
        "messages": [{"role": "user", "content": PROMPT + "\n\n" + CALC}],
        "max_tokens": 8,
    }
    t0 = time.monotonic()
    with httpx.Client(trust_env=False, timeout=timeout_s) as client:
        client.post(f"{url}/v1/chat/completions", json=body).raise_for_status()
    return time.monotonic() - t0


def wait_for_llama(bin_dir: Path, wait_s: float) -> bool:
    """Whether llama-server is built, waiting up to ``wait_s`` for a build in progress."""
    deadline = time.monotonic() + wait_s
    while not (bin_dir / "llama-server").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(10)
    return True


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mlxserve.cli.bench import llamacpp

    p = argparse.ArgumentParser(
        prog="mlxserve bench agents",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="a .gguf (default: the embedded SmolLM2)")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument(
        "--clients", default="claude-code,codex,aider", help=f"of {','.join(clients.ALL)}"
    )
    p.add_argument("--servers", default="mlxserve,llama-server")
    p.add_argument(
        "--time-limit", type=float, default=600.0, help="seconds per client session (all turns)"
    )
    p.add_argument(
        "--turns",
        type=int,
        default=len(TURNS),
        choices=range(1, len(TURNS) + 1),
        help="client invocations per session: the task, then follow-ups that continue it",
    )
    p.add_argument("--max-turns", type=int, default=8, help="Claude Code's --max-turns")
    p.add_argument(
        "--max-output-tokens",
        type=int,
        default=1024,
        help="the servers' default max_tokens, and the clients' own output limit where they "
        "have one (a tiny model under greedy decoding repeats itself until told to stop)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server -t")
    p.add_argument("--llama-bin", type=Path, default=llamacpp.bin_dir())
    p.add_argument(
        "--llama-wait", type=float, default=0.0, help="seconds to wait for a llama.cpp build"
    )
    p.add_argument("--mlxserve-arg", action="append", default=[], help="extra `serve` flag")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress shows as it happens in a log file
    # SIGTERM unwinds like Ctrl-C, so every server, proxy and client is stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = args.out or cache_dir() / "agents" / "runs" / stamp
    out.mkdir(parents=True, exist_ok=True)
    root = cache_dir() / "agents"
    wanted = [c for c in args.clients.split(",") if c]
    unknown = set(wanted) - set(clients.ALL)
    if unknown:
        raise SystemExit(f"--clients: unknown {sorted(unknown)}; known: {','.join(clients.ALL)}")
    from mlxserve.loader import resolve_model

    source = resolve_model(args.model)
    if source.kind != "gguf":
        raise SystemExit(
            f"--model: a .gguf is needed (llama-server reads it too), got {source.path}"
        )
    model, model_note = servers.with_context(source.path, args.max_model_len)
    doc: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "load_start": os.getloadavg(),
        "model": model_note,
        "prompts": TURNS,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "clients": {},
        "servers": {},
        "runs": [],
    }
    exes: dict[str, Path] = {}
    for name in wanted:
        try:
            exes[name], version = clients.install(name, root)
            doc["clients"][name] = {"version": version, "exe": str(exes[name])}
        except (subprocess.SubprocessError, OSError, KeyError, ValueError) as exc:
            doc["clients"][name] = {"install_error": f"{type(exc).__name__}: {exc}"}
        print(f"[agents] {name}: {doc['clients'][name]}")
    src = args.llama_bin.parent / "src"
    results = doc["runs"]
    try:
        with NetCatcher() as catcher:
            for server_name in [s for s in args.servers.split(",") if s]:
                if server_name == "mlxserve":
                    spec = servers.mlxserve_spec(
                        model, args.max_model_len, args.max_output_tokens, out, args.mlxserve_arg
                    )
                    doc["servers"][server_name] = {"cmd": spec.cmd}
                elif server_name == "llama-server":
                    if not wait_for_llama(args.llama_bin, args.llama_wait):
                        doc["servers"][server_name] = {
                            "skipped": f"no {args.llama_bin}/llama-server"
                        }
                        results += [
                            {
                                "client": c,
                                "server": server_name,
                                "skipped": "llama-server not built",
                            }
                            for c in wanted
                        ]
                        continue
                    spec = servers.llama_server_spec(
                        args.llama_bin,
                        model,
                        args.max_model_len,
                        args.max_output_tokens,
                        args.threads,
                    )
                    doc["servers"][server_name] = {
                        "cmd": spec.cmd,
                        "routes_in_source": servers.llama_server_routes(src),
                    }
                else:
                    raise SystemExit(f"--servers: unknown {server_name!r}")
                with Server(spec, out) as server:
                    doc["servers"][server_name]["warmup_s"] = warm_up(server.url)
                    for name in wanted:
                        if name not in exes:
                            results.append(
                                {"client": name, "server": server_name, "skipped": "install failed"}
                            )
                            continue
                        results.append(run_client(name, exes[name], server, catcher, out, args))
                        print(report.table(results[-1:]).splitlines()[-1], flush=True)
                        (out / "results.json").write_text(json.dumps(doc, indent=2))
    finally:
        doc["load_end"] = os.getloadavg()
        (out / "results.json").write_text(json.dumps(doc, indent=2))
    print(f"\nload average at start {doc['load_start']}, at end {doc['load_end']}")
    print(report.table(results))
    print(f"\nresults: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
