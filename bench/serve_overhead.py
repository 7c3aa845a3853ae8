"""Where the server's time per token goes: the same decode three ways, on one engine.

    PYTHONPATH=. python bench/serve_overhead.py                     # c=1 and c=32
    PYTHONPATH=. python bench/serve_overhead.py --clients 32 --max-num-batched-tokens 2048

Modes, each on the same engine (the embedded SmolLM2 GGUF unless MODEL is given), with
the server's step budget unless told otherwise, distinct 32-token prompts and greedy
``ignore_eos`` requests of ``--max-tokens``:

    offline  LLMEngine.step(delta=True) in a loop on the main thread
    async    AsyncLLM (the engine thread) with C asyncio consumers on the main thread's
             event loop, no HTTP
    http     the server's app (as `mlxserve serve` builds it, metrics included) under
             uvicorn on a thread of this process; C streaming /v1/completions clients in
             a child process, so the clients' CPU is not counted

Per mode: time per output token (TPOT = (last token - first token) / (tokens - 1),
median over requests), output tok/s over the decode window, engine steps, the event-loop
wakeups that handed outputs over (AsyncLLM.num_handoffs), the process's CPU time per
output token, and on Linux that CPU split by thread (/proc/self/task): "engine" (the
thread that steps: main offline, AsyncLLM's otherwise), "loop" (the thread serving
HTTP or the consumers), and MLX's and the kernels' compute threads. On a loaded machine
wall times are noise; CPU times and counts much less so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CLIENT = r"""
import asyncio, json, sys, time
import httpx

async def one(c, prompt, max_tokens):
    times = [time.perf_counter()]  # sent, then each text event
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                if ev.get("choices") and ev["choices"][0].get("text"):
                    times.append(time.perf_counter())
    return times

async def main(url, prompts, max_tokens):
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as c:
        print(json.dumps(await asyncio.gather(*(one(c, p, max_tokens) for p in prompts))))

url, max_tokens = sys.argv[1], int(sys.argv[2])
asyncio.run(main(url, json.loads(sys.stdin.read()), max_tokens))
"""


def thread_cpu_ms() -> dict[int, float]:
    """CPU time (user + system, ms) of each thread of this process; {} off Linux."""
    out = {}
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10.0
    for entry in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(entry.name)] = (int(fields[11]) + int(fields[12])) * tick_ms
    return out


class Accounting:
    """Process and per-thread CPU over a measured run, with the threads' roles."""

    def __init__(self, roles: dict[int, str]) -> None:
        self.roles = roles
        self.cpu0, self.threads0 = time.process_time(), thread_cpu_ms()

    def finish(self, num_tokens: int) -> dict[str, float]:
        cpu = time.process_time() - self.cpu0
        res = {"cpu_ms_per_token": cpu * 1000 / num_tokens}
        split: dict[str, float] = {}
        for tid, ms in thread_cpu_ms().items():
            role = self.roles.get(tid, "compute")  # MLX's stream and the kernels' pool
            split[role] = split.get(role, 0.0) + (ms - self.threads0.get(tid, 0.0))
        for role, ms in sorted(split.items()):
            res[f"{role}_cpu_ms_per_token"] = ms / num_tokens
        return res


def summarize(sent_and_times: list[list[float]]) -> dict[str, float]:
    """TTFT and TPOT medians (ms), decode tok/s, from each request's send time followed by
    its tokens' arrival times."""
    import numpy as np

    ttft = [t[1] - t[0] for t in sent_and_times]
    per_request = [t[1:] for t in sent_and_times]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) * 1000 for t in per_request if len(t) > 1]
    start = min(t[0] for t in per_request)
    end = max(t[-1] for t in per_request)
    return {
        "ttft_p50_ms": float(np.median(ttft)) * 1000,
        "tpot_p50_ms": float(np.median(tpot)),
        "decode_tok_s": sum(len(t) - 1 for t in per_request) / max(end - start, 1e-9),
        "tokens": sum(len(t) for t in per_request),
    }


def params(max_tokens: int):
    from mlxserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_offline(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Add every prompt, then step until done; token times as the step returns them."""
    times: dict[str, list[float]] = {}
    for i, ids in enumerate(prompts):
        rid = f"off-{i}-{time.time()}"
        times[rid] = [time.perf_counter()]
        engine.add_request(rid, None, params(max_tokens), prompt_token_ids=ids)
    acct = Accounting({threading.get_native_id(): "engine"})
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step(delta=True)
        steps += 1
        now = time.perf_counter()
        for out in outs:
            times.setdefault(out.request_id, []).extend([now] * len(out.outputs[0].token_ids))
    res = summarize(list(times.values()))
    return res | acct.finish(res["tokens"]) | {"steps": steps}


def steps(llm) -> int:
    return getattr(llm, "num_steps", -1)  # -1: an AsyncLLM from before the counters


def handoffs(llm) -> int:
    return getattr(llm, "num_handoffs", -1)


def run_async(llm, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """C consumers of AsyncLLM.generate on this thread's event loop."""

    async def one(i: int, ids: list[int]) -> list[float]:
        times = [time.perf_counter()]
        rid = f"as-{i}-{time.time()}"
        async for out in llm.generate(rid, None, params(max_tokens), prompt_token_ids=ids):
            times.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
        return times

    async def main() -> list[list[float]]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    roles = {threading.get_native_id(): "loop", llm._thread.native_id: "engine"}  # noqa: SLF001
    acct, counts = Accounting(roles), (steps(llm), handoffs(llm))
    res = summarize(asyncio.run(main()))
    res |= acct.finish(res["tokens"])
    return res | {"steps": steps(llm) - counts[0], "handoffs": handoffs(llm) - counts[1]}


class HttpServer:
    """The server's app over ``llm`` under uvicorn on a thread of this process."""

    def __init__(self, llm) -> None:
        import uvicorn

        from mlxserve.server.app import ServerConfig, build_app
        from mlxserve.server.metrics import ServerMetrics

        engine = llm.engine
        metrics = ServerMetrics(engine.model_name)
        llm._on_step = metrics.on_step  # noqa: SLF001 -- as `mlxserve serve` wires it
        app = build_app(llm, metrics, ServerConfig(model_names=(engine.model_name,)))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def run_http(llm, server: HttpServer, texts: list[str], max_tokens: int) -> dict[str, float]:
    """C streaming clients in a child process against ``server``."""
    roles = {server.thread.native_id: "loop", llm._thread.native_id: "engine"}  # noqa: SLF001
    acct, counts = Accounting(roles), (steps(llm), handoffs(llm))
    child = subprocess.run(
        [sys.executable, "-c", CLIENT, f"http://127.0.0.1:{server.port}", str(max_tokens)],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        check=True,
    )
    res = summarize(json.loads(child.stdout))
    res |= acct.finish(res["tokens"])
    return res | {"steps": steps(llm) - counts[0], "handoffs": handoffs(llm) - counts[1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--modes", default="offline,async,http")
    p.add_argument("--rounds", type=int, default=1, help="repeat each case; best TPOT kept")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: serve's")
    p.add_argument(
        "--async-scheduling",
        choices=["auto", "on", "off"],
        default="auto",
        help="LLMEngine.async_scheduling (auto: the engine's choice, on where it applies)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from mlxserve.cli.bench.workload import make_engine, make_prompts
    from mlxserve.engine.async_llm import AsyncLLM
    from mlxserve.engine.startup import default_max_num_batched_tokens

    # The server's step budget in every mode, so that each mode runs the same steps.
    budget = args.max_num_batched_tokens or default_max_num_batched_tokens(serving=True)
    engine = make_engine(args.model, max_num_batched_tokens=budget)
    if args.async_scheduling != "auto":
        engine.async_scheduling = args.async_scheduling == "on"
    tok = engine.tokenizer
    print(f"async scheduling {engine.async_scheduling}; budget {budget} tokens per step")
    print(f"load average at start: {os.getloadavg()}")
    run_offline(engine, make_prompts(tok, 2, 32, start=900), 8)  # warm up
    results: dict[str, dict] = {}
    llm = server = None
    for mode in args.modes.split(","):  # offline first: AsyncLLM's thread steps from then on
        if mode != "offline" and llm is None:
            llm = AsyncLLM(engine)
        if mode == "http" and server is None:
            server = HttpServer(llm)
        for c in args.clients:
            best = None
            for r in range(args.rounds):
                prompts = make_prompts(tok, c, 32, start=10_000 * (r + 1) + 100 * c)
                if mode == "offline":
                    res = run_offline(engine, prompts, args.max_tokens)
                elif mode == "async":
                    res = run_async(llm, prompts, args.max_tokens)
                else:
                    texts = [tok.decode(ids) for ids in prompts]
                    res = run_http(llm, server, texts, args.max_tokens)
                if best is None or res["tpot_p50_ms"] < best["tpot_p50_ms"]:
                    best = res
            results[f"{mode} c={c}"] = best
            shown = {k: round(v, 2) for k, v in best.items()}
            print(f"{mode:>8} c={c:<3} {json.dumps(shown)}", flush=True)
    if server is not None:
        server.close()
    if llm is not None:
        llm.shutdown()
    print(f"load average at end: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
