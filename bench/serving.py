"""Serving workloads against OpenAI-compatible servers: mlxserve, mlx-lm, llama.cpp.

Each server runs alone (started, measured, stopped); clients stream /v1/completions,
greedy, on localhost. Workloads:

    concurrency C   C clients in a closed loop, R requests each, distinct prompts
    mixed           D streams decode while long prompts arrive one after another:
                    ITL p99 / p50 of the decoding streams shows if prefill stalls them
    shared prefix   requests one after another, a long common system prompt plus a
                    short distinct question: TTFT with and without prefix caching
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.common import ROOT, child_env, percentile


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
    """A running server process (context manager)."""

    def __init__(self, spec: ServerSpec, logs: Path) -> None:
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logs / f"{spec.name}.log"

    def __enter__(self) -> Server:
        cmd = [*self.spec.cmd, self.spec.port_flag, str(self.port)]
        print(f"[{self.spec.name}] starting: {' '.join(cmd)}", flush=True)
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
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
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.__exit__()
        raise TimeoutError(f"{self.spec.name} not ready:\n{self.log.read_text()[-3000:]}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


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


async def _stream(client: httpx.AsyncClient, body: dict) -> RequestResult:
    sent = time.perf_counter()
    times: list[float] = []
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


async def mixed(
    url: str,
    stream_prompts: list[str],
    stream_tokens: int,
    long_prompts: list[str],
    long_gap_s: float,
) -> dict[str, float]:
    """Streams decode; long prompts (1 output token... a few) arrive every long_gap_s."""
    async with client(url, len(stream_prompts) + len(long_prompts)) as c:
        await one_request(c, body("Warm up.", 4))
        t0 = time.perf_counter()
        streams = [
            asyncio.create_task(one_request(c, body(p, stream_tokens))) for p in stream_prompts
        ]
        await asyncio.sleep(long_gap_s)
        longs = []
        for p in long_prompts:
            longs.append(asyncio.create_task(one_request(c, body(p, 4))))
            await asyncio.sleep(long_gap_s)
        stream_results = await asyncio.gather(*streams)
        long_results = await asyncio.gather(*longs)
        wall = time.perf_counter() - t0
    out = summarize(stream_results, wall)
    out["itl_p99_over_p50"] = out["itl_p99_ms"] / out["itl_p50_ms"]
    out["itl_max_ms"] = max(x * 1000 for r in stream_results for x in r.itls)
    out["long_ttft_p50_ms"] = percentile([r.ttft * 1000 for r in long_results], 50)
    return out


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
