"""How much of a coding agent's session does the prefix cache serve, turn after turn?

Replays a session shaped like Claude Code's (bodies written here, not its text) against
`mlxserve serve`, once per --prompt-normalization setting, each on a fresh server: a first
system block with a billing header whose `cch` changes every request, a long system prompt
ending in a `<total_tokens>` budget that falls every turn, 20 tools, and turns that each add
the assistant's tool call, a tool result of a file's worth of text with its own budget
marker, and a `<system-reminder>` text block (as Claude Code sends them)::

    PYTHONPATH=. python bench/session_replay.py MODEL [--turns 10] [--out FILE]
    PYTHONPATH=. python bench/session_replay.py MODEL --base-url http://127.0.0.1:8080  # any
                                                 # server with /v1/messages (llama-server)

Per turn it prints the prompt, the tokens the cache served (Anthropic's
cache_read_input_tokens) and the time to the answer (max_tokens 1: the prompt's cost). A
perfect prefix cache serves all of the previous turn's prompt: "reuse" is the served
tokens over that, summed over the turns after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the parser reads each token and the scheduler assigns blocks to requests".split()


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n_words))


def session(turns: int, system_words: int, result_words: int) -> list[dict]:
    """The request bodies of a session, one per turn."""
    tools = [
        {
            "name": f"tool_{i}",
            "description": text(40, i),
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
        for i in range(20)
    ]
    messages: list[dict] = [{"role": "user", "content": "Find the bug in the scheduler."}]
    bodies = []
    for turn in range(turns):
        budget = f"<total_tokens>{200_000 - 3_000 * turn} tokens left</total_tokens>"
        system = [
            {
                "type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1.0; cch={turn:05x};",
            },
            {"type": "text", "text": f"{text(system_words, 1)}\n{budget}"},
        ]
        bodies.append({"model": "m", "max_tokens": 1, "system": system, "tools": tools,
                       "messages": list(messages), "temperature": 0})  # fmt: skip
        call = {"type": "tool_use", "id": f"t{turn}", "name": "tool_0", "input": {"path": "a.py"}}
        result = {"type": "tool_result", "tool_use_id": f"t{turn}",
                  "content": f"{text(result_words, turn)}\n{budget}"}  # fmt: skip
        reminder = {
            "type": "text",
            "text": f"<system-reminder>Turn {turn}: keep going.</system-reminder>",
        }
        messages += [
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result, reminder]},
        ]
    return bodies


def serve(model: str, port: int, normalization: str, max_model_len: int, log: Path):
    cmd = [sys.executable, "-m", "mlxserve", "serve", model, "--port", str(port)]
    cmd += ["--served-model-name", "m", "--max-model-len", str(max_model_len)]
    cmd += ["--prompt-normalization", normalization, "--kv-cache-disk-bytes", "0"]
    cmd += ["--max-num-batched-tokens", "2048", "--disable-log-stats"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-2000:])
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def replay(url: str, bodies: list[dict]) -> list[dict]:
    rows = []
    for body in bodies:
        start = time.perf_counter()
        r = httpx.post(url + "/v1/messages", json=body, timeout=3600)
        r.raise_for_status()
        usage = r.json()["usage"]
        prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
        rows.append({"prompt": prompt, "cached": usage["cache_read_input_tokens"],
                     "seconds": round(time.perf_counter() - start, 2)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system-words", type=int, default=6000)
    p.add_argument("--result-words", type=int, default=900)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--settings", default="all,none", help="--prompt-normalization values")
    p.add_argument("--base-url", default=None, help="replay against this server instead")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    bodies = session(args.turns, args.system_words, args.result_words)
    results = {"uptime_start": os.getloadavg(), "model": args.model, "runs": {}}
    for normalization in [args.base_url] if args.base_url else args.settings.split(","):
        if args.base_url:
            rows = replay(args.base_url, bodies)
        else:
            log = Path(f"/tmp/session-replay-{normalization}.log")
            proc, url = serve(args.model, args.port, normalization, args.max_model_len, log)
            try:
                rows = replay(url, bodies)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
        served = sum(r["cached"] for r in rows[1:])
        possible = sum(r["prompt"] for r in rows[:-1])
        results["runs"][normalization] = {"turns": rows, "reuse": round(served / possible, 4)}
        print(f"\n{normalization}: reuse {served / possible:.1%}")
        print("| turn | prompt | cached | seconds |\n|---:|---:|---:|---:|")
        for i, r in enumerate(rows):
            print(f"| {i} | {r['prompt']} | {r['cached']} | {r['seconds']} |")
    results["uptime_end"] = os.getloadavg()
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
