"""mlxserve vs mlx-lm on a tiny MoE and a tiny hybrid model, in one run (issue 12).

    PYTHONPATH=. python bench/zoo_vs_mlx_lm.py                       # qwen3_moe + qwen3_5
    PYTHONPATH=. python bench/zoo_vs_mlx_lm.py --batch-sizes 8 --max-tokens 16 --hidden 128

Each model is a seeded random-weight mlx-lm model built from the model-zoo test configs
(tests/zoo_configs.py, scaled up by the flags) and saved as a local model directory
(config.json + float32 safetensors + a small BPE tokenizer). Float32 because that is what
mlxserve computes in on the CPU anyway and the fastest setting for mlx-lm here (float16 on
MLX's CPU backend is emulated); both engines read the same file.

On each model: single stream (mlxserve ``LLM.generate`` on one prompt vs mlx-lm's
``generate_step``, the loop under ``mlx_lm.generate``) and batches of N mixed-length
prompts (``LLM.generate`` vs ``batch_generate``); greedy, EOS ignored, the same token ids.
Each case runs on fresh prompts (so no prefix cache helps) twice: with one output token,
whose wall time is the "prefill" time, and with --max-tokens. --repeat rounds, each on its
own prompts, best kept; the engines take turns round by round, so a change in the machine's
load hits all alike. Reported: prefill seconds, output tok/s (all output tokens / wall),
decode tok/s (the tokens after the first / (wall - prefill)), mlxserve / mlx-lm speed
ratios (> 1: mlxserve faster), and how many greedy tokens agree (random tiny models have
near-tied logits, so a late divergence can be float noise; the count is printed, not
hidden). mlx-lm runs in its own process with MLX's stock BLAS ("mlx-lm") and, unless
--no-mlx-lm-openblas, with the OpenBLAS mlxserve binds ("mlx-lm+openblas").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxserve import settings  # noqa: E402

settings.start()  # bind the optimized BLAS, as a command does, before anything computes
from bench.peers.mlx_lm_zoo_worker import run_cases  # noqa: E402
from mlxserve.cli.bench.common import (  # noqa: E402
    STOCK_ENV,
    child_env,
    find_openblas,
    openblas_env,
    run_json,
)

ROOT = Path(__file__).resolve().parent.parent
MLX_LM_ZOO_WORKER = ROOT / "bench" / "peers" / "mlx_lm_zoo_worker.py"
MODELS = ("qwen3_moe", "qwen3_5", "qwen3_next")


def model_config(name: str, args: argparse.Namespace) -> dict:
    """The zoo test config of ``name``, scaled to the bench's sizes."""
    from tests.zoo_configs import ZOO

    heads = max(1, args.hidden // args.head_dim)
    cfg = ZOO[name] | {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "intermediate_size": 2 * args.hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": args.head_dim,
        "vocab_size": args.vocab,
        "max_position_embeddings": 4096,
    }
    if "num_experts" in cfg:
        cfg |= {
            "num_experts": args.experts,
            "num_experts_per_tok": args.top_k,
            "moe_intermediate_size": max(8, args.hidden // 2),
        }
        if "shared_expert_intermediate_size" in cfg:
            cfg["shared_expert_intermediate_size"] = max(8, args.hidden // 2)
    if "linear_num_value_heads" in cfg:  # gated delta net: 3 linear layers per attention one
        cfg |= {
            "linear_num_key_heads": max(1, heads // 2),
            "linear_num_value_heads": heads,
            "linear_key_head_dim": args.head_dim,
            "linear_value_head_dim": args.head_dim,
            "full_attention_interval": min(4, args.layers),
        }
    return cfg


def build_model_dir(name: str, args: argparse.Namespace, work: Path, seed: int) -> Path:
    """A seeded random mlx-lm checkpoint of ``name`` with a tokenizer, in float32."""
    from tests.engine_helpers import write_tokenizer
    from tests.model_helpers import make_mlx_lm_checkpoint

    _, path = make_mlx_lm_checkpoint(work / name, model_config(name, args), seed=seed)
    write_tokenizer(path)
    return path


def make_prompts(rng, count: int, args: argparse.Namespace) -> list[list[int]]:
    """``count`` random prompts of mixed lengths in [--min-prompt, --max-prompt]."""
    lens = rng.integers(args.min_prompt, args.max_prompt + 1, count)
    return [rng.integers(3, args.vocab, int(n)).tolist() for n in lens]


def make_spec(model_dir: Path, args: argparse.Namespace, seed: int) -> dict:
    """The prompts of every case, the same for both engines.

    A case has --repeat rounds of fresh prompts; in each, the prefill prompts have the
    lengths of the decode prompts (other tokens, so no prefix cache hit).
    """
    import numpy as np

    rng = np.random.default_rng(seed)

    def rounds(count: int) -> list[dict]:
        out = []
        for _ in range(args.repeat):
            decode = make_prompts(rng, count, args)
            prefill = [rng.integers(3, args.vocab, len(ids)).tolist() for ids in decode]
            out.append({"prefill": prefill, "decode": decode})
        return out

    cases = [{"name": "single", "tokens": args.single_tokens, "rounds": rounds(1)}]
    for n in args.batch_sizes:
        cases.append({"name": f"batch{n}", "tokens": args.max_tokens, "rounds": rounds(n)})
    return {"model": str(model_dir), "warmup": make_prompts(rng, 4, args), "cases": cases}


def mlxserve_runner(spec: dict):
    """``run(prompts, max_tokens) -> (wall, token ids)`` through one warmed-up LLM."""
    from mlxserve import LLM, SamplingParams

    sizes = [len(c["rounds"][0]["decode"]) for c in spec["cases"]]
    llm = LLM(spec["model"], max_num_seqs=max(sizes))

    def run(prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        assert all(len(t) == n for t in tokens), [len(t) for t in tokens]
        return wall, tokens

    run(spec["warmup"], 4)
    run(spec["warmup"][:1], 4)
    return run


def one_round(spec: dict, r: int) -> dict:
    """``spec`` with round ``r`` of each case only."""
    cases = [c | {"rounds": [c["rounds"][r]]} for c in spec["cases"]]
    return spec | {"cases": cases}


def merge_rounds(rounds: list[dict]) -> dict:
    """Per case: every round's prefill and whole-run walls, and tokens."""
    out = {}
    for case in rounds[0]:
        if not isinstance(rounds[0][case], dict):
            continue
        out[case] = {
            "prefill_s": [s for r in rounds for s in r[case]["prefill_s"]],
            "wall_s": [s for r in rounds for s in r[case]["wall_s"]],
            "token_ids": [ids for r in rounds for ids in r[case]["token_ids"]],
        }
    return out


def run_model(spec: dict, peers: list, work: Path, name: str) -> dict:
    """Every engine on ``spec``, round by round (mlxserve, then each peer), so a change in
    the machine's load hits every engine alike; engine -> merged results."""
    run = mlxserve_runner(spec)
    rounds: dict[str, list[dict]] = {"mlxserve": []} | {peer: [] for peer, _ in peers}
    for r in range(len(spec["cases"][0]["rounds"])):
        this = one_round(spec, r)
        rounds["mlxserve"].append(run_cases(this, run, "mlxserve"))
        for peer, env in peers:
            rounds[peer].append(run_mlx_lm(this, env, work, f"{name}-{peer}-{r}"))
    return {engine: merge_rounds(res) for engine, res in rounds.items()}


def run_mlx_lm(spec: dict, env: dict[str, str], work: Path, name: str) -> dict:
    """mlx-lm's side of ``spec``, in a child process with ``env``."""
    spec_path, out = work / f"{name}-spec.json", work / f"{name}-out.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(MLX_LM_ZOO_WORKER), str(spec_path), str(out)]
    return run_json(cmd, child_env(env), out)


def case_numbers(res: dict, num_prompts: int, tokens: int) -> dict:
    """Prefill seconds, output tok/s and decode tok/s of one engine's case: each the best
    over the rounds, the decode rate from a prefill and a whole run of the same round."""
    decodes = [w - p for w, p in zip(res["wall_s"], res["prefill_s"], strict=True)]
    # Noise can make wall - prefill <= 0 on a busy machine: no decode number from that round.
    rates = [num_prompts * (tokens - 1) / d for d in decodes if d > 0]
    return {
        "prefill_s": min(res["prefill_s"]),
        "tok_s": num_prompts * tokens / min(res["wall_s"]),
        "decode_tok_s": max(rates, default=float("nan")),
    }


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How many prompts give identical greedy tokens, and tokens agreeing before a divergence."""
    same_prefix = []
    for a, b in zip(ours, theirs, strict=True):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        same_prefix.append(k)
    return {
        "identical": sum(a == b for a, b in zip(ours, theirs, strict=True)),
        "prompts": len(ours),
        "tokens_before_divergence": sum(same_prefix),
        "tokens": sum(len(a) for a in ours),
        "first_divergence": min(
            (k for k, a in zip(same_prefix, ours, strict=True) if k < len(a)), default=None
        ),
    }


def report(name: str, spec: dict, results: dict[str, dict]) -> dict:
    """Print one model's table and return its numbers."""
    cases = [(c["name"], len(c["rounds"][0]["decode"]), c["tokens"]) for c in spec["cases"]]
    peers = [p for p in results if p != "mlxserve"]
    out: dict = {}
    print(f"\n== {name} ==")
    head = f"{'case':8s} {'engine':24s} {'prefill s':>9s} {'tok/s':>8s} {'decode tok/s':>12s}"
    print(head + "  greedy tokens agreeing with mlxserve")
    for case, n, tokens in cases:
        out[case] = {}
        for engine, res in results.items():
            nums = case_numbers(res[case], n, tokens)
            line = (
                f"{case:8s} {engine:24s} {nums['prefill_s']:9.3f} {nums['tok_s']:8.1f} "
                f"{nums['decode_tok_s']:12.1f}"
            )
            if engine != "mlxserve":
                agree = agreement(results["mlxserve"][case]["token_ids"], res[case]["token_ids"])
                nums["agreement"] = agree
                line += (
                    f"  {agree['identical']}/{agree['prompts']} identical, "
                    f"{agree['tokens_before_divergence']}/{agree['tokens']} before a divergence"
                )
                if agree["first_divergence"] is not None:
                    line += f" (first at step {agree['first_divergence']})"
            print(line)
            out[case][engine] = nums
        for peer in peers:
            a, b = out[case]["mlxserve"], out[case][peer]
            ratios = {
                "prefill": b["prefill_s"] / a["prefill_s"],
                "tok_s": a["tok_s"] / b["tok_s"],
                "decode_tok_s": a["decode_tok_s"] / b["decode_tok_s"],
            }
            out[case][f"mlxserve/{peer}"] = ratios
            print(
                f"{case:8s} {'mlxserve/' + peer:24s} {ratios['prefill']:9.2f} "
                f"{ratios['tok_s']:8.2f} {ratios['decode_tok_s']:12.2f}  (speed ratios)"
            )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen3_moe", "qwen3_5"], choices=MODELS)
    p.add_argument("--batch-sizes", nargs="*", type=int, default=[8, 32])
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per batch prompt")
    p.add_argument("--single-tokens", type=int, default=64, help="output tokens, single stream")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=384, help="<= 384: the tokenizer's vocabulary")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--repeat", type=int, default=1, help="rounds per case (best is kept)")
    p.add_argument("--no-mlx-lm-openblas", action="store_true", help="skip mlx-lm + OpenBLAS")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    p.add_argument("--json", type=Path, default=None, help="write every number here")
    args = p.parse_args(argv)
    counts = {
        "--max-tokens": args.max_tokens,
        "--single-tokens": args.single_tokens,
        "--min-prompt": args.min_prompt,
        "--layers": args.layers,
        "--experts": args.experts,
        "--top-k": args.top_k,
        "--repeat": args.repeat,
    }
    for flag, value in counts.items():
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if any(n < 1 for n in args.batch_sizes):
        p.error(f"--batch-sizes must all be >= 1, got {args.batch_sizes}")
    if args.max_prompt < args.min_prompt:
        p.error(f"--max-prompt ({args.max_prompt}) must be >= --min-prompt ({args.min_prompt})")
    if not 4 <= args.vocab <= 384:
        p.error(f"--vocab must be in [4, 384] (the test tokenizer's size), got {args.vocab}")
    if args.top_k > args.experts:
        p.error(f"--top-k ({args.top_k}) must be <= --experts ({args.experts})")
    if args.hidden % args.head_dim:
        p.error(f"--hidden ({args.hidden}) must be a multiple of --head-dim ({args.head_dim})")
    return args


def main(argv: list[str] | None = None) -> int:
    import os

    args = parse_args(argv)
    from mlxserve.cli.bench.workload import device_info

    info = device_info()
    print(f"device: {info['device']}  mlx {info['mlx']}  blas: {info['blas']}")
    print(f"load average at start: {os.getloadavg()}")
    peers = [("mlx-lm", STOCK_ENV)]
    blas = find_openblas()
    if blas and not args.no_mlx_lm_openblas:
        peers.append(("mlx-lm+openblas", openblas_env(blas)))
    work = args.workdir or Path(tempfile.mkdtemp(prefix="zoo-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    everything: dict = {"settings": {k: str(v) for k, v in vars(args).items()}, "models": {}}
    everything["load_start"] = os.getloadavg()
    for seed, name in enumerate(args.models):
        path = build_model_dir(name, args, work, seed)
        spec = make_spec(path, args, seed)
        results = run_model(spec, peers, work, name)
        everything["models"][name] = {
            "config": json.loads((path / "config.json").read_text()),
            "results": report(name, spec, results),
        }
    everything["load_end"] = os.getloadavg()
    print(f"\nload average at end: {everything['load_end']}")
    if args.json:
        args.json.write_text(json.dumps(everything, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
