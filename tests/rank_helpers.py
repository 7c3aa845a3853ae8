"""Running tests/tp_script.py in a fresh process (with its ranks) and failing a rank.

A spawn is bounded in time: on timeout the script and its ranks (one session) are killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.paths import ROOT

TIMEOUT = 240  # seconds for one multi-rank run (generous: 2 shared cores)


class Spawn:
    """``python -m tests.tp_script ARGS`` (or ``cmd``), stdout piped, stderr to a file."""

    def __init__(self, args: list[str], log: Path, cmd: list[str] | None = None) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 -- closed in finish()
        self.proc = subprocess.Popen(
            [*(cmd or [sys.executable, "-m", "tests.tp_script"]), *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,  # a timeout kills the script and its ranks together
        )

    def __enter__(self) -> Spawn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()  # a failed assertion must not leave the script and its ranks spinning

    def log(self) -> str:
        return self.log_path.read_text()

    def read_until(self, tag: str) -> str:
        """The rest of the first stdout line starting with ``tag`` (blocks until it comes)."""
        seen = []
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return line[len(tag) + 1 :]
            seen.append(line)
        self.kill()
        pytest.fail(f"no {tag} line\n{''.join(seen)}\n{self.log()[-3000:]}")

    def finish(self, timeout: float = TIMEOUT) -> str:
        """The rest of stdout once the script exits (killed and failed after ``timeout``)."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"multi-rank run did not finish in {timeout} s\n{self.log()[-3000:]}")
        finally:
            self._log.close()
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def result_line(stdout: str, tag: str) -> dict | list:
    lines = [line for line in stdout.splitlines() if line.startswith(tag + " ")]
    assert lines, stdout
    return json.loads(lines[-1][len(tag) + 1 :])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running
        return f.read().split(")")[-1].split()[0] != "Z"


def fail_a_rank(run: Spawn, how: signal.Signals, timeout: float = 60) -> dict:
    """Once the script generates (after --then-fail), send ``how`` to rank 1 mid-generation.

    Returns what the engine raised ({} if the watchdog ended the process instead) and
    ``rank_left``: whether rank 1 still ran after the script ended (then it is killed).
    """
    (rank_pid, *_) = json.loads(run.read_until("RANKS"))
    try:
        time.sleep(1.0)  # mid-generation
        os.kill(rank_pid, how)
        out = run.finish(timeout)  # the bound against a hang
        left = alive(rank_pid)
    finally:
        run.kill()
        if alive(rank_pid):
            os.kill(rank_pid, signal.SIGKILL)
    if run.proc.returncode == 0:  # the usual way: the collective fails, the engine raises
        return result_line(out, "ERROR") | {"rank_left": left}
    # A collective queued on the broken ring blocked: the watchdog ended the process.
    assert run.proc.returncode == 1, run.log()[-3000:]
    return {"rank_left": left}


def kill_a_rank_and_check_it_failed_fast(run: Spawn) -> None:
    """SIGKILL rank 1 mid-generation: the engine raises RankLostError naming it (or, if a
    collective blocked, the watchdog ends the process saying why), and no rank is left."""
    failed = fail_a_rank(run, signal.SIGKILL)
    if failed.get("type"):  # the usual way: the collective fails, the engine raises
        assert failed["type"] == "RankLostError"
        assert "rank 1 exited (killed by signal 9)" in failed["message"]
        assert failed["gone"] is True
    else:  # a collective queued on the broken ring blocked: the watchdog ended the process
        assert "a rank is gone (rank 1 exited (killed by signal 9))" in run.log()
    assert not failed["rank_left"]


def assert_logprobs_close(got: list[list[float]], want: list[list[float]], nats: float) -> None:
    """Every text's every token's log-prob within ``nats`` of ``want``'s."""
    assert [len(t) for t in got] == [len(t) for t in want]
    pairs = zip(got, want, strict=True)
    worst = max(abs(g - w) for gs, ws in pairs for g, w in zip(gs, ws, strict=True))
    assert worst <= nats, f"a token's log-prob moved by {worst:.4f} nats (at most {nats})"
