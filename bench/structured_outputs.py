"""Structured outputs: 32 json_schema requests vs the same requests unconstrained, one run.

    PYTHONPATH=. python bench/structured_outputs.py                  # SmolLM2, 32 x 64 tokens
    PYTHONPATH=. python bench/structured_outputs.py MODEL --num-prompts 8 --max-tokens 32

Both batches use the same prompt token ids, greedy, and generate exactly --max-tokens
tokens per request: the free batch ignores EOS, the constrained one asks for an array of at
least 500 strings, which cannot end sooner. Reported: output tok/s of each and their ratio
(goal >= 0.9), the host time per step spent building grammar bitmasks (computed while the
step's forward pass runs), and the time to compile a schema, small and large, and the
longest pause of 8 streaming requests while a large one compiles (AsyncLLM compiles off
the engine thread).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMA = {
    "type": "object",
    "properties": {
        "words": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 500,
        },
        "done": {"type": "boolean"},
    },
    "required": ["words", "done"],
    "additionalProperties": False,
}


def big_schema(n: int = 60) -> dict:
    """n object types in $defs, each referenced by a property: a large compile."""
    fields = {f"f{j}": {"type": ["string", "integer", "null"]} for j in range(8)}
    defs = {f"T{i}": {"type": "object", "properties": fields, "required": ["f0"]} for i in range(n)}
    props = {f"p{i}": {"$ref": f"#/$defs/T{i}"} for i in range(n)}
    return {"$defs": defs, "type": "object", "properties": props, "required": ["p0"]}


def run_batch(llm, prompts, params) -> tuple[float, int, int]:
    """(wall seconds, output tokens, engine steps) of one batch through LLM.generate."""
    steps = 0
    step = llm.engine.step

    def counting_step(*args, **kwargs):
        nonlocal steps
        steps += 1
        return step(*args, **kwargs)

    llm.engine.step = counting_step
    try:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        del llm.engine.step
    return wall, sum(len(o.outputs[0].token_ids) for o in outs), steps


def compile_times(engine) -> dict[str, float]:
    from mlxserve.sampling_params import StructuredOutputsParams

    out = {}
    for name, schema in (("small", SCHEMA), ("large_60_defs", big_schema())):
        params = StructuredOutputsParams(json=schema)
        t0 = time.perf_counter()
        engine.grammars._compile(params)  # uncached
        out[name] = time.perf_counter() - t0
    return out


def pause_while_compiling(engine, prompts, num_tokens: int) -> dict[str, float]:
    """8 streams decode while a large schema compiles (AsyncLLM: in a worker thread).

    Reports the median gap between two outputs of a stream, and the longest gap of any
    stream that overlaps the compile: close to the median when the engine thread goes on.
    """
    from mlxserve.engine.async_llm import AsyncLLM
    from mlxserve.sampling_params import SamplingParams, StructuredOutputsParams

    llm = AsyncLLM(engine)
    free = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    stamps: dict[int, list[float]] = {i: [] for i in range(8)}
    window: list[float] = []
    compile_structured_output = engine.compile_structured_output

    def timed_compile(params, *args):
        if params.structured_outputs is None:
            return None
        window.append(time.perf_counter())
        try:
            return compile_structured_output(params, *args)
        finally:
            window.append(time.perf_counter())

    engine.compile_structured_output = timed_compile

    async def stream(i: int) -> None:
        async for _ in llm.generate(f"s{i}", None, free, prompt_token_ids=prompts[i]):
            stamps[i].append(time.perf_counter())

    async def big() -> None:
        while sum(map(len, stamps.values())) < 8 * num_tokens // 3:
            await asyncio.sleep(0.05)  # the streams are decoding
        so = StructuredOutputsParams(json=big_schema(120))
        params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=so)
        async for _ in llm.generate("big", None, params, prompt_token_ids=prompts[8]):
            pass

    async def main() -> None:
        await asyncio.gather(*(stream(i) for i in range(8)), big())

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
        del engine.compile_structured_output
    start, end = window
    gaps, during = [], [0.0]
    for ts in stamps.values():
        for a, b in zip(ts, ts[1:], strict=False):
            gaps.append(b - a)
            if b >= start and a <= end:
                during.append(b - a)
    gaps.sort()
    return {
        "compile_s": end - start,
        "median_gap_s": gaps[len(gaps) // 2],
        "max_gap_while_compiling_s": max(during),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", default=None, help="write the numbers here")
    args = p.parse_args(argv)

    import mlx.core as mx

    from mlxserve import LLM, SamplingParams
    from mlxserve.cli.bench.workload import make_prompts
    from mlxserve.sampling_params import StructuredOutputsParams

    print(f"device: {mx.default_device()}")
    llm = LLM(args.model, max_num_seqs=max(64, args.num_prompts))
    runner = llm.engine.runner
    prompts = make_prompts(llm.get_tokenizer(), args.num_prompts, args.prompt_tokens, start=7000)
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    so = StructuredOutputsParams(json=SCHEMA)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=so)
    # Warm up both paths (kernels, the grammar tokenizer, the schema's compile).
    run_batch(llm, prompts[:2], free)
    run_batch(llm, prompts[:2], constrained)
    results: dict[str, dict] = {}
    for name, params in (("unconstrained", free), ("json_schema", constrained)):
        steps0, mask0 = runner.num_mask_steps, runner.mask_seconds
        wall, tokens, steps = run_batch(llm, prompts, params)
        masked_steps = runner.num_mask_steps - steps0
        results[name] = {
            "tok_s": tokens / wall,
            "output_tokens": tokens,
            "wall_s": wall,
            "steps": steps,
            "step_ms": 1e3 * wall / steps,
            "mask_ms_per_step": 1e3 * (runner.mask_seconds - mask0) / max(masked_steps, 1),
        }
        r = results[name]
        print(
            f"{name:14s} {r['tok_s']:7.1f} tok/s  {tokens} tokens  {steps} steps  "
            f"{r['step_ms']:.1f} ms/step  masks {r['mask_ms_per_step']:.2f} ms/step"
        )
    ratio = results["json_schema"]["tok_s"] / results["unconstrained"]["tok_s"]
    print(f"constrained / unconstrained throughput: {ratio:.3f} (goal >= 0.9)")
    results["ratio"] = {"json_schema_over_unconstrained": ratio}
    results["compile_s"] = compile_times(llm.engine)
    print(
        "schema compile: "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in results["compile_s"].items())
    )
    more = make_prompts(llm.get_tokenizer(), 9, args.prompt_tokens, start=9000)
    results["streams_while_compiling"] = pause_while_compiling(llm.engine, more, 48)
    s = results["streams_while_compiling"]
    print(
        f"8 streams while a 120-$defs schema compiles ({s['compile_s'] * 1e3:.0f} ms, off the "
        f"engine thread): median gap {s['median_gap_s'] * 1e3:.0f} ms, longest gap overlapping "
        f"the compile {s['max_gap_while_compiling_s'] * 1e3:.0f} ms"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
