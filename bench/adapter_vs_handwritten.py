"""The mlx-lm adapter vs the hand-written llama model, same weights, same engine.

    PYTHONPATH=. python bench/adapter_vs_handwritten.py            # embedded SmolLM2 GGUF
    PYTHONPATH=. python bench/adapter_vs_handwritten.py MODEL --rounds 2

Both engines load MODEL the way ``load_model`` does (on the CPU: float32, quantized layers
dequantized); one runs mlxserve's hand-written model, the other mlx-lm's class for the same
model_type through mlxserve.models.mlx_lm_adapter. Each round measures both (alternating
which goes first) with ``mlxserve bench``'s offline runs: single-stream decode (128 tokens
after a 32-token prompt), prefill of 512 tokens, and batch 32 x 32 tokens. Greedy tokens of
both are compared first, then the model forward alone is timed: decode steps at batch 1 and
32, interleaved (min and median; on a loaded machine this says more than the end-to-end
rounds). Prints one table per round and the adapter / hand-written ratios.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxserve import settings  # noqa: E402

settings.start()  # bind the optimized BLAS, as a command does, before anything computes


def load_both(model: str | None):
    """(hand-written LoadedModel, adapter LoadedModel) over the same weights."""
    import mlx.core as mx

    from mlxserve.loader import (
        LoadedModel,
        cast_weights,
        load_gguf,
        load_model,
        read_model_dir,
        resolve_model,
        should_dequantize,
    )
    from mlxserve.models import dequantize_model, load_weights_strict, mlx_lm_zoo

    hand = load_model(model)
    source = resolve_model(model)
    if source.kind == "gguf":
        config, weights, _ = load_gguf(source.path)
    else:
        config, weights = read_model_dir(source.path)
    weights = cast_weights(weights, hand.dtype)
    net = mlx_lm_zoo.build(config, weights, load_weights=load_weights_strict)
    mx.eval(net.parameters())
    if should_dequantize(net, hand.dtype):
        dequantize_model(net, hand.dtype)
    return hand, LoadedModel(net, hand.tokenizer, config, source, hand.dtype)


def make_engine(loaded):
    from mlxserve.config import EngineConfig
    from mlxserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=None, max_num_seqs=64), loaded=loaded)


def same_greedy_tokens(engines: dict, num_prompts: int = 4, max_tokens: int = 24) -> bool:
    """Both engines give the same greedy tokens for a few prompts."""
    from mlxserve import SamplingParams
    from mlxserve.cli.bench import make_prompts

    outs = {}
    for name, engine in engines.items():
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        prompts = make_prompts(engine.tokenizer, num_prompts, 32, start=300)
        got = {}
        for i, ids in enumerate(prompts):
            engine.add_request(f"check{i}", None, params, prompt_token_ids=ids)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = out.outputs[0].token_ids
        outs[name] = [got[f"check{i}"] for i in range(num_prompts)]
    first, *rest = outs.values()
    return all(r == first for r in rest)


def step_times(models: dict, batch: int, num_steps: int, context: int = 32) -> dict:
    """Decode-step times (s) of each model, interleaved: ``batch`` requests at ``context``
    cached tokens each, one new token each, over a block pool as the runner builds it."""
    import mlx.core as mx

    from mlxserve.models import KVCache
    from mlxserve.ops import AttentionMetadata

    bs = 16
    blocks_per_req = -(-(context + 1) // bs)
    tables = [[1 + i * blocks_per_req + j for j in range(blocks_per_req)] for i in range(batch)]
    md = AttentionMetadata.build([1] * batch, [context + 1] * batch, tables, bs)
    ids = mx.array([7] * batch, dtype=mx.int32)
    positions = mx.array([context] * batch, dtype=mx.int32)
    rows = mx.arange(batch, dtype=mx.int32)
    caches = {
        name: KVCache.allocate_for(m, 1 + batch * blocks_per_req, bs, mx.float32)
        for name, m in models.items()
    }
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(num_steps + 2):
        for name, model in models.items():
            cache = caches[name]
            t0 = time.perf_counter()
            logits = model(ids, positions, md, cache, rows)
            mx.eval(logits, cache.keys, cache.values)
            if i >= 2:  # the first two build and warm up
                times[name].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="decode steps per model, step timing")
    args = p.parse_args(argv)

    import mlx.core as mx

    from mlxserve.cli.bench import OfflineSpec, device_info, run_offline

    info = device_info()
    print(f"device: {info['device']}  mlx {info['mlx']}  blas: {info['blas']}")
    hand, adapted = load_both(args.model)
    print(f"hand-written: {type(hand.model).__module__}; adapter: {type(adapted.model).__name__}")
    engines = {"hand-written": make_engine(hand), "adapter": make_engine(adapted)}
    print(f"greedy tokens identical: {same_greedy_tokens(engines)}")
    models = {name: loaded.model for name, loaded in (("hand-written", hand), ("adapter", adapted))}
    print(f"\ndecode step, model forward + eval only (min / median of {args.steps}, interleaved)")
    print(f"{'batch':6s} {'hand-written ms':>16s} {'adapter ms':>11s} {'ratio (min)':>12s}")
    for batch in (1, 32):
        t = step_times(models, batch, args.steps)
        h, a = sorted(t["hand-written"]), sorted(t["adapter"])
        print(
            f"{batch:<6d} {h[0] * 1e3:7.1f} / {h[len(h) // 2] * 1e3:6.1f} "
            f"{a[0] * 1e3:5.1f} / {a[len(a) // 2] * 1e3:5.1f} {a[0] / h[0]:12.2f}"
        )
    spec = OfflineSpec(batch_sizes=(32,))
    keys = ("decode_tok_s", "prefill_tok_s", "batch32_tok_s")
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        res = {}
        for name in order:
            mx.clear_cache()
            t0 = time.perf_counter()
            res[name] = run_offline(engines[name], spec, log=lambda _: None)
            res[name]["seconds"] = time.perf_counter() - t0
        print(f"\nround {r + 1} (first: {order[0]})")
        print(f"{'tok/s':24s} {'hand-written':>13s} {'adapter':>9s} {'ratio':>6s}")
        for k in keys:
            h, a = res["hand-written"][k], res["adapter"][k]
            print(f"{k:24s} {h:13.1f} {a:9.1f} {a / h:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
