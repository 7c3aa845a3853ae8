"""Serving latency at one concurrency level: mlxserve vs its peers, same weights, one run.

    PYTHONPATH=. python bench/serve_latency.py                    # embedded SmolLM2 GGUF
    PYTHONPATH=. python bench/serve_latency.py MODEL --num-clients 8 --max-tokens 64
    PYTHONPATH=. python bench/serve_latency.py --peers mlxserve,mlx-lm,llama.cpp

Starts each server in turn on a free localhost port (`mlxserve serve MODEL`,
`mlx_lm server --model DIR` with DIR = MODEL converted by `mlxserve convert`, and
llama.cpp's llama-server when asked). N clients each send their requests one after
another (closed loop), streaming, greedy, every request a different prompt. Per server:
TTFT, TPOT, ITL (p50 / p99) and output tok/s; then ratios peer / mlxserve for latencies
(> 1: mlxserve is faster) and mlxserve / peer for tok/s. bench/run.py runs the full sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import serving  # noqa: E402
from bench.common import mlx_lm_model  # noqa: E402
from bench.peers import llamacpp  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--peers", default="mlxserve,mlx-lm", help="of mlxserve,mlx-lm,llama.cpp")
    p.add_argument("--num-clients", type=int, default=4)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="mlxserve serve's step token budget (default: the server's)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    from bench.run import server_specs, text_prompts
    from mlxserve.loader import resolve_model
    from mlxserve.tokenizer import Tokenizer

    args.peers = [x for x in args.peers.split(",") if x]
    source = resolve_model(args.model)
    if source.kind != "gguf":
        raise SystemExit("serve_latency.py needs a .gguf MODEL")
    tok = Tokenizer.from_gguf(source.path)
    if "mlx-lm" in args.peers:
        args.mlx_dirs = {"q": mlx_lm_model(str(source.path), "q")}
    if "llama.cpp" in args.peers:
        llamacpp.ensure_built()
    work = Path(tempfile.mkdtemp(prefix="serve-latency-"))
    n, per = args.num_clients, args.requests_per_client
    texts = text_prompts(tok, n * per, 32, start=40_000)
    prompts = [texts[i * per : (i + 1) * per] for i in range(n)]
    results: dict[str, dict] = {}
    for name, spec in server_specs(args, source.path, n, 256).items():
        with serving.Server(spec, work) as srv:
            res, wall = asyncio.run(serving.closed_loop(srv.url, prompts, args.max_tokens))
        results[name] = serving.summarize(res, wall)

    print(f"\nmodel {source.name}; {n} clients x {per} requests, max_tokens {args.max_tokens}\n")
    names = list(results)
    print(f"{'metric':<16}" + "".join(f"{x:>12}" for x in names))
    for k in next(iter(results.values())):
        print(f"{k:<16}" + "".join(f"{results[x][k]:>12.1f}" for x in names))
    if "mlxserve" in results:
        for peer in names[1:]:
            ours, theirs = results["mlxserve"], results[peer]
            tps = ours["output_tok_s"] / theirs["output_tok_s"]
            lat = {k: theirs[k] / ours[k] for k in ours if k.endswith("_ms")}
            print(f"\n{peer} vs mlxserve: output tok/s x{tps:.2f}; latency ratios (peer / ours):")
            print("  " + ", ".join(f"{k} {v:.2f}" for k, v in lat.items()))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "results": results}, indent=2, default=str)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
