"""Serving workloads against OpenAI-compatible servers: mlxserve, mlx-lm, llama.cpp.

Each server runs alone (started, measured, stopped); clients stream /v1/completions,
greedy, on localhost. Workloads:

    concurrency C   C clients in a closed loop, R requests each, distinct prompts
    under load      D streams keep decoding while prompts arrive one after another
                    (`mlxserve bench peers`' "mixed": 8 streams, two long prompts; "busy": 32
                    streams, short prompts): the streams' ITL while the arrivals are
                    processed (does prefill stall them?) and the arrivals' TTFT (does
                    decoding starve them?)
    shared prefix   requests one after another, a long common system prompt plus a
                    short distinct question: TTFT with and without prefix caching
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import httpx
import numpy as np

from mlxserve.cli.bench.common import child_env, percentile


@dataclass
class ServerSpec:
    name: str
    cmd: list[str]  # without the port flag
    port_flag: str = "--port"
    health: str = "/health"
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class RequestResult:
    ttft: float
    e2e: float
    num_tokens: int
    itls: list[float] = field(default_factory=list)
    sent: float = 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running server process (context manager); once stopped, ``peak_rss_mib`` is the
    process's peak resident set: every page it had resident at once, file-backed ones
    such as a memory-mapped model included (VmHWM just before it is stopped; where /proc
    does not tell it, ru_maxrss, which also counts the parent's pages at the fork)."""

    def __init__(self, spec: ServerSpec, logs: Path) -> None:
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logs / f"{spec.name}.log"
        self.peak_rss_mib: float | None = None
        self.ready_rss_mib: float | None = None  # when it first answered /health (Linux)

    def __enter__(self) -> Server:
        cmd = [*self.spec.cmd, self.spec.port_flag, str(self.port)]
        print(f"[{self.spec.name}] starting: {' '.join(cmd)}", flush=True)
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(
            cmd,
            env=child_env(self.spec.env),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + self.spec.health, timeout=2).status_code == 200:
                    self.ready_rss_mib = proc_status_mib(self.proc.pid)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.__exit__()
        raise TimeoutError(f"{self.spec.name} not ready:\n{self.log.read_text()[-3000:]}")

    def __exit__(self, *exc) -> None:
        peak = proc_status_mib(self.proc.pid, "VmHWM")
        self.proc.terminate()
        maxrss = reap(self.proc, timeout_s=30)
        self.peak_rss_mib = peak if peak is not None else maxrss
        self._log_file.close()


class RunningServer:
    """A server started elsewhere (`mlxserve bench serve --base-url`): measured only, never
    started or stopped; its memory and CPU time are not this process's to read."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.proc: subprocess.Popen | None = None
        self.peak_rss_mib: float | None = None
        self.ready_rss_mib: float | None = None

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc) -> None:
        return None


def cpu_seconds(pid: int) -> float | None:
    """CPU time a process has used so far, all its threads (user + system), where /proc
    tells it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def proc_status_mib(pid: int, key: str = "VmRSS") -> float | None:
    """A memory figure of /proc/PID/status in MiB (VmRSS: resident now; VmHWM: the peak of
    the program it runs, since its exec), or None where /proc does not tell it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 2**10
    except OSError:
        pass
    return None


def reap(proc: subprocess.Popen, timeout_s: float) -> float | None:
    """Wait for ``proc`` to exit (killed after timeout_s) and return its ru_maxrss in MiB
    (None if it was already reaped). On Linux that is at least the parent's resident set
    when it was spawned (exec keeps the larger of the two), hence VmHWM above."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        except ChildProcessError:
            proc.wait()
            return None
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.1)
    proc.returncode = os.waitstatus_to_exitcode(status)
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    return usage.ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


async def one_request(client: httpx.AsyncClient, body: dict, retries: int = 3) -> RequestResult:
    """One streamed request; a refused or reset connection is retried (mlx-lm's
    http.server has a listen backlog of 5), and the retry's wait counts in its TTFT."""
    sent = time.perf_counter()
    for attempt in range(retries + 1):
        try:
            result = await _stream(client, body)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            if attempt == retries:
                raise
            await asyncio.sleep(0.5)
            continue
        result.ttft += result.sent - sent
        result.e2e += result.sent - sent
        result.sent = sent
        return result
    raise AssertionError("unreachable")


async def _stream(
    client: httpx.AsyncClient, body: dict, times: list[float] | None = None
) -> RequestResult:
    """One streamed request; the arrival time of each text event is appended to times."""
    sent = time.perf_counter()
    times = [] if times is None else times
    num_tokens = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                num_tokens = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.perf_counter())
    done = time.perf_counter()
    if not times:
        raise RuntimeError(f"no text streamed for {body['prompt'][:40]!r}")
    return RequestResult(
        ttft=times[0] - sent,
        e2e=done - sent,
        num_tokens=num_tokens if num_tokens is not None else len(times),
        itls=np.diff(times).tolist(),
        sent=sent,
    )


def body(prompt: str, max_tokens: int) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # mlxserve and llama.cpp honour it; mlx-lm ignores it
    }


def client(url: str, n: int) -> httpx.AsyncClient:
    # A fresh connection per request: mlx-lm's http.server closes kept-alive ones.
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=url, timeout=3600, limits=limits)


def summarize(results: list[RequestResult], wall: float) -> dict[str, float]:
    ttft = [r.ttft * 1000 for r in results]
    tpot = [(r.e2e - r.ttft) / (r.num_tokens - 1) * 1000 for r in results if r.num_tokens > 1]
    itl = [x * 1000 for r in results for x in r.itls]
    total = sum(r.num_tokens for r in results)
    return {
        "requests": len(results),
        "output_tokens": total,
        "wall_s": wall,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "tpot_p50_ms": percentile(tpot, 50),
        "tpot_p99_ms": percentile(tpot, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "output_tok_s": total / wall,
    }


async def closed_loop(
    url: str, prompts: list[list[str]], max_tokens: int
) -> tuple[list[RequestResult], float]:
    """prompts[c] are client c's requests, sent one after another."""
    async with client(url, len(prompts)) as c:
        await one_request(c, body("Warm up.", 4))

        async def worker(mine: list[str]) -> list[RequestResult]:
            return [await one_request(c, body(p, max_tokens)) for p in mine]

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(worker(p) for p in prompts))
        wall = time.perf_counter() - t0
    return [r for rs in per_client for r in rs], wall


def window_itls(requests: list[list[float]], t0: float, t1: float) -> list[float]:
    """Gaps between consecutive tokens of one request that end inside [t0, t1]."""
    return [b - a for times in requests for a, b in pairwise(times) if t0 <= b <= t1]


class BackgroundStreams:
    """Streams that keep decoding until stop(): one that ends (EOS, max_tokens, the
    engine's context limit) is sent again at once, so every engine stays loaded."""

    def __init__(self, c: httpx.AsyncClient, prompts: list[str], max_tokens: int) -> None:
        # Token arrival times: per stream, one list per request sent.
        self.streams: list[list[list[float]]] = [[] for _ in prompts]
        self.num_restarts = 0
        self._tasks = [
            asyncio.create_task(self._run(c, i, body(p, max_tokens))) for i, p in enumerate(prompts)
        ]

    @property
    def requests(self) -> list[list[float]]:
        """Token arrival times of every request sent, one list per request."""
        return [times for stream in self.streams for times in stream]

    async def _run(self, c: httpx.AsyncClient, index: int, request: dict) -> None:
        while True:
            times: list[float] = []
            self.streams[index].append(times)
            try:
                await _stream(c, request, times)
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                await asyncio.sleep(0.5)  # mlx-lm's small listen backlog; try again
            self.num_restarts += 1
            await asyncio.sleep(0)  # let the other tasks run even if nothing above waited

    async def wait_tokens(self, count: int, since: float = 0.0, timeout_s: float = 1800) -> float:
        """Wait until every stream has streamed count tokens after since; the time of the
        last of those tokens."""
        deadline = time.perf_counter() + timeout_s
        while True:
            nth = [_nth_after(stream, since, count) for stream in self.streams]
            if all(t is not None for t in nth):
                return max(nth)  # type: ignore[type-var]
            for task in self._tasks:
                if task.done():
                    task.result()  # re-raise what stopped it
            if time.perf_counter() > deadline:
                raise TimeoutError(f"streams did not all stream {count} tokens in {timeout_s} s")
            await asyncio.sleep(0.05)

    def all_alive(self) -> bool:
        """True while no stream task has died (an error, not a restart)."""
        return not any(task.done() for task in self._tasks)

    async def stop(self) -> None:
        """Cancel every stream (the client disconnects) and surface any error."""
        for task in self._tasks:
            task.cancel()
        for result in await asyncio.gather(*self._tasks, return_exceptions=True):
            if not isinstance(result, asyncio.CancelledError):
                raise RuntimeError(f"a background stream failed: {result!r}")


def _nth_after(stream: list[list[float]], since: float, count: int) -> float | None:
    later = [t for times in stream for t in times if t > since]
    return later[count - 1] if len(later) >= count else None


async def under_load(
    url: str,
    stream_prompts: list[str],
    stream_max_tokens: int,
    arrivals: list[str],
    arrival_max_tokens: int,
    gap_s: float,
) -> dict[str, float]:
    """Streams decode; prompts arrive gap_s apart; measured while the arrivals are served.

    Once every stream decodes: a decode-only baseline (gap_s, and at least 3 gaps per
    stream), then the arrivals. The window opens when the first arrival is sent and
    closes when the last one is answered (all its tokens); the streams keep decoding
    through it, for every engine. Stream ITLs inside the window (p99 / p50: stalls caused
    by prefill), the arrivals' TTFT (starvation of prefill by decoding).
    """
    async with client(url, len(stream_prompts) + len(arrivals)) as c:
        await one_request(c, body("Warm up.", 4))
        streams = BackgroundStreams(c, stream_prompts, stream_max_tokens)
        decoding = await streams.wait_tokens(1)
        # Decode-only baseline: gap_s, and at least 3 gaps of every stream.
        await asyncio.gather(asyncio.sleep(gap_s), streams.wait_tokens(3, since=decoding))
        t0 = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(arrivals):
            if i:
                await asyncio.sleep(gap_s)
            tasks.append(asyncio.create_task(one_request(c, body(prompt, arrival_max_tokens))))
        results = await asyncio.gather(*tasks)
        t1 = time.perf_counter()
        alive = streams.all_alive()
        await streams.stop()
    if not alive:
        raise RuntimeError("a background stream stopped during the window")
    itl = [x * 1000 for x in window_itls(streams.requests, t0, t1)]
    baseline = [x * 1000 for x in window_itls(streams.requests, decoding, t0)]
    num_stream_tokens = sum(t0 <= t <= t1 for times in streams.requests for t in times)
    ttft = [r.ttft * 1000 for r in results]
    return {
        "window_s": t1 - t0,
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "itl_p99_over_p50": percentile(itl, 99) / percentile(itl, 50),
        "itl_max_ms": max(itl),
        "baseline_itl_p50_ms": percentile(baseline, 50),
        "stream_tok_s": num_stream_tokens / (t1 - t0),
        "arrival_ttft_p50_ms": percentile(ttft, 50),
        "arrival_ttft_max_ms": max(ttft),
        "stream_restarts": streams.num_restarts,
    }


async def shared_prefix(url: str, prompts: list[str], max_tokens: int) -> dict[str, float]:
    """Requests one after another; TTFT of all but the first (which fills the cache)."""
    async with client(url, 1) as c:
        await one_request(c, body("Warm up.", 4))
        results = [await one_request(c, body(p, max_tokens)) for p in prompts]
    ttft = [r.ttft * 1000 for r in results[1:]]
    return {
        "first_ttft_ms": results[0].ttft * 1000,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_mean_ms": float(np.mean(ttft)),
        "requests": len(results),
    }
