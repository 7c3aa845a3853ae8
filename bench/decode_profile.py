"""One decode step taken apart: host (Python) vs MLX evaluation, and compute per part.

    PYTHONPATH=. python bench/decode_profile.py [MODEL] [--batch 1 8] [--steps 20] [--ops]
        [--overlap-rounds 3] [--json F]

Two measurements of the same model (default: the embedded SmolLM2-135M Q4_1):

1. **Engine steps.** B requests (32-token prompts, greedy, ignore_eos) are prefilled,
   then STEPS decode-only steps run through ``LLMEngine.step()`` with MLX's evaluation made
   synchronous (``mx.async_eval`` replaced by ``mx.eval`` for the run), so every part of a
   step is either Python on the host or time blocked in MLX, never both:
   schedule / update / process (engine and scheduler), build = the runner's graph building
   (with its pieces: step metadata, the model's graph, the sampler's batch and graph),
   eval (MLX: dispatch of every op + compute), read (results to host lists). The op count
   is the number of nodes MLX evaluates for one step (``mx.export_to_dot`` of the graph);
   ``--ops`` prints them by primitive (a histogram: which pieces are op-heavy).
   These steps run in the synchronous order (async scheduling off), so that each part's
   Python is timed alone.
2. **Parts.** The compute of each kind of op at the step's shapes, alone: every layer's
   projections, the LM head, attention (K/V write + paged attention), RoPE, norms, the
   elementwise rest (SwiGLU, residual adds), the sampler; each evaluated as one graph of
   all its layers (so the per-``eval`` cost is paid once), best of ``--repeats``. And
   MLX's dispatch cost per op: a chain of 1,000 adds on a (B, hidden) array.
3. **Exposed host time.** The same B requests decoded by the real engine loop
   (``mx.async_eval`` as is), rounds alternating async scheduling on and off: wall and CPU
   time per step. With eval = the synchronous eval-only time of the same steps (a third
   run from the same fresh requests, each evaluation timed as in 1.), the host time left
   exposed is wall - eval, its share (wall - eval) / wall: what the Python
   of a step costs once async scheduling overlaps it with the compute (the overlapped
   Python still takes a core: on a 2-core machine it competes with the compute's threads,
   which the CPU time per step shows).
4. **Verification rows.** A forward pass over 1, 2, 5, 8 decode rows of one request (as a
   speculative verification is laid out) after ``--verify-context`` cached tokens, and
   its attention alone, best of ``--repeats`` (wall and CPU time), relative to one row.

On a busy machine wall times mean little; the step's CPU time (every thread of the
process, ``time.process_time``) does, with ``MLXSERVE_CPU_THREADS=1`` (no spinning
helper threads): then it is the work one step costs, whoever else runs.

The parts are measured alone, so their sum differs from eval (no overlap, other cache
state); they say where the compute goes, the engine step says how much is host time.
Numbers on a shared machine move; run it when the load average is low (it is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from mlxserve.cli.bench.workload import make_engine, make_prompts  # noqa: E402
from mlxserve.sampling_params import SamplingParams  # noqa: E402


def op_histogram(outputs: list[mx.array]) -> dict[str, int]:
    """Nodes MLX would evaluate for ``outputs`` (primitives, not inputs or constants), by
    primitive name, most frequent first."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "g.dot"
        mx.export_to_dot(str(path), *outputs)
        text = path.read_text()
    # Primitive nodes are drawn as rectangles; arrays as ovals.
    counts: dict[str, int] = defaultdict(int)
    for name in re.findall(r'label\s*=\s*"([^"]*)",\s*shape\s*=\s*rectangle', text):
        counts[name] += 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def count_ops(outputs: list[mx.array]) -> int:
    """Nodes MLX would evaluate for ``outputs`` (primitives, not inputs or constants)."""
    return sum(op_histogram(outputs).values())


class _Timer:
    """Accumulates seconds per name while wrapped callables run."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo: list[tuple[object, str, object, bool]] = []

    def wrap(self, obj: object, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        own = attr in vars(obj) if hasattr(obj, "__dict__") else True

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[name] += time.perf_counter() - t

        self._undo.append((obj, attr, fn, own))
        setattr(obj, attr, timed)

    def restore(self) -> None:
        for obj, attr, fn, own in reversed(self._undo):
            if own:
                setattr(obj, attr, fn)
            else:
                delattr(obj, attr)
        self._undo.clear()


def start_decoding(engine, batch: int, max_tokens: int, tag: str) -> list[str]:
    """Add ``batch`` greedy requests (32-token prompts) and step until all are decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = make_prompts(engine.tokenizer, batch, 32, start=70_000 + batch)
    ids = [f"{tag}{batch}-{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, None, params, prompt_token_ids=p)
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    for _ in range(3):  # warm: decode-only steps, shapes seen
        engine.step()
    return ids


def stop_decoding(engine, ids: list[str]) -> None:
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()


def profile_overlap(engine, batch: int, steps: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU ms per decode step of the real engine loop at ``batch``
    requests, async scheduling on vs off, and the eval-only compute of the same steps
    (synchronous order, ``mx.async_eval`` made ``mx.eval`` and timed); in ``rounds``
    rounds, each mode from the same fresh requests (same contexts: prefix-cache hits)."""
    was_async = engine.async_scheduling
    runs: dict[str, list[tuple[float, float]]] = {"async": [], "sync": [], "eval": []}
    blocked = [0.0]

    def eval_now(*arrays):
        t = time.perf_counter()
        mx.eval(*arrays)
        blocked[0] += time.perf_counter() - t

    try:
        for _ in range(rounds):
            for mode in runs:
                engine.async_scheduling = mode == "async"
                ids = start_decoding(engine, batch, steps + 16, f"overlap-{mode}")
                if mode == "eval":
                    mx.async_eval, blocked[0] = eval_now, 0.0
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    for _ in range(steps):
                        engine.step()
                finally:
                    mx.async_eval = _ASYNC_EVAL
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if mode == "eval":
                    wall = blocked[0]
                runs[mode].append((wall / steps * 1000, cpu / steps * 1000))
                stop_decoding(engine, ids)
    finally:
        engine.async_scheduling = was_async
    out = {}
    for mode, vals in runs.items():
        walls, cpus = sorted(v[0] for v in vals), sorted(v[1] for v in vals)
        out[mode] = {"step": walls[len(walls) // 2], "cpu": cpus[len(cpus) // 2]}
    return out


def profile_engine(
    engine, batch: int, steps: int, histogram: dict[str, int] | None = None
) -> dict[str, float]:
    """Mean ms per decode step at ``batch`` requests, per part (see module docstring);
    ``histogram`` (if given) gets the step's ops by primitive."""
    from mlxserve.worker import model_runner, step_build

    ids = start_decoding(engine, batch, steps + 16, "prof")
    runner = engine.runner
    t = _Timer()
    sync_eval = mx.eval
    ops_per_step = []

    def eval_now(*arrays):  # the step's graph, evaluated synchronously
        if not ops_per_step:
            counts = op_histogram(list(arrays))
            ops_per_step.append(sum(counts.values()))
            if histogram is not None:
                histogram.update(counts)
        sync_eval(*arrays)

    t.wrap(engine.scheduler, "schedule", "schedule")
    t.wrap(engine.scheduler, "update_from_output", "update")
    t.wrap(engine, "_process", "process")
    t.wrap(runner, "_build", "build")
    t.wrap(model_runner, "read_part", "read")
    t.wrap(step_build, "step_metadata", "build: step metadata")
    t.wrap(step_build, "make_sampling_batch", "build: sampler batch")
    t.wrap(step_build, "sample", "build: sampler graph")
    t.wrap(runner, "model", "build: model graph")
    mx.async_eval = eval_now
    t.wrap(mx, "async_eval", "eval")
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            engine.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        t.restore()
        mx.async_eval = _ASYNC_EVAL
    stop_decoding(engine, ids)
    ms = {k: v / steps * 1000 for k, v in t.seconds.items()}
    ms["step"] = wall / steps * 1000
    ms["cpu"] = cpu / steps * 1000  # CPU time of all threads: robust to other load
    ms["host"] = ms["step"] - ms.get("eval", 0.0)
    ms["ops"] = float(ops_per_step[0]) if ops_per_step else 0.0
    return ms


_ASYNC_EVAL = mx.async_eval


def _best_ms(fn, repeats: int) -> float:
    for _ in range(2):
        mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t)
    return best * 1000


def _linears(module: nn.Module) -> list[nn.Module]:
    """The projection layers of a block (anything with a 2-D weight), in order."""
    return [
        m
        for _, m in module.named_modules()
        if "weight" in m and getattr(m["weight"], "ndim", 0) == 2 and not isinstance(m, nn.RMSNorm)
    ]


def _in_dims(linear: nn.Module) -> int:
    w = linear["weight"]
    bits = getattr(linear, "bits", None)
    return w.shape[-1] * 32 // bits if w.dtype == mx.uint32 and bits else w.shape[-1]


def profile_parts(model, batch: int, repeats: int, context: int = 48) -> dict[str, float]:
    """Compute per kind of op at a decode step's shapes (best of ``repeats``), in ms."""
    from mlxserve.models.base import KVCache, cached_attention
    from mlxserve.ops import AttentionMetadata
    from mlxserve.worker.sampler import SamplingState, make_sampling_batch, sample

    stack = model.model
    layers = stack.layers
    hidden = model.args.hidden_size
    mx.random.seed(0)
    out: dict[str, float] = {}
    inputs: dict[int, mx.array] = {}

    def x_for(dims: int) -> mx.array:
        if dims not in inputs:
            inputs[dims] = mx.random.normal((batch, dims)) * 0.1
            mx.eval(inputs[dims])
        return inputs[dims]

    attn_linears = [(m, x_for(_in_dims(m))) for layer in layers for m in _linears(layer.self_attn)]
    mlp_linears = [(m, x_for(_in_dims(m))) for layer in layers for m in _linears(layer.mlp)]
    out["matmul: attention projections"] = _best_ms(
        lambda: [m(x) for m, x in attn_linears], repeats
    )
    out["matmul: MLP projections"] = _best_ms(lambda: [m(x) for m, x in mlp_linears], repeats)
    head = stack.embed_tokens.as_linear if model.args.tie_word_embeddings else model.lm_head
    x = x_for(hidden)
    out["matmul: LM head"] = _best_ms(lambda: head(x), repeats)
    attn = layers[0].self_attn
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    bs = 16
    nblk = -(-(context + 1) // bs)
    cache = KVCache.allocate_for(model, 1 + batch * nblk, bs, mx.float32)
    tables = [[1 + b * nblk + i for i in range(nblk)] for b in range(batch)]
    md = AttentionMetadata.build([1] * batch, [context + 1] * batch, tables, bs)
    q = mx.random.normal((batch, nh, hd))
    k = mx.random.normal((batch, nkv, hd))
    mx.eval(q, k, cache.arrays())

    def attention():
        outs = []
        for i in range(len(layers)):
            outs.append(cached_attention(cache, i, q, k, k, md, attn.scale))
        return outs + cache.arrays()

    out["attention (K/V write + paged)"] = _best_ms(attention, repeats)
    pos = mx.full((batch,), context, dtype=mx.int32)
    out["rope (q and k)"] = _best_ms(
        lambda: [layer.self_attn.rope(t, pos) for layer in layers for t in (q, k)],
        repeats,
    )
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    out["norms"] = _best_ms(lambda: [n(x) for n in norms + [stack.norm]], repeats)
    h = x_for(model.args.intermediate_size)
    out["elementwise (SwiGLU, residual adds)"] = _best_ms(
        lambda: [nn.silu(h) * h for _ in layers] + [x + x for _ in range(2 * len(layers))], repeats
    )
    logits = mx.random.normal((batch, model.vocab_size))
    mx.eval(logits)
    greedy = SamplingParams(temperature=0.0)
    states = [SamplingState(greedy, 0, [1]) for _ in range(batch)]
    out["sampler (greedy)"] = _best_ms(
        lambda: sample(logits, make_sampling_batch(states, model.vocab_size)).token_ids, repeats
    )
    z = mx.zeros((batch, hidden))
    mx.eval(z)

    def chain():
        y = z
        for _ in range(1000):
            y = y + 1
        return y

    out["MLX dispatch per op (us)"] = _best_ms(chain, repeats)  # ms per 1000 = us per op
    return out


def profile_verification(model, rows: list[int], repeats: int, context: int = 60) -> dict:
    """Best-of-``repeats`` wall and CPU ms of a forward pass over n decode rows of one
    request (how the runner lays out a speculative verification: the rows' positions
    follow ``context`` tokens already cached, each row attends up to its own position),
    for each n in ``rows``, interleaved; the forward's attention alone (every layer's
    K/V write and paged attention at the same shapes); each relative to one row."""
    from mlxserve import ops
    from mlxserve.models.base import KVCache
    from mlxserve.ops import AttentionMetadata

    bs = 16
    nblk = -(-(context + max(rows)) // bs)
    cache = KVCache.allocate_for(model, 1 + nblk, bs, mx.float32)
    mx.eval(cache.arrays())
    table = list(range(1, 1 + nblk))
    layers = model.model.layers
    attn = layers[0].self_attn
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = {n: mx.random.normal((n, nh, hd)) for n in rows}
    k = {n: mx.random.normal((n, nkv, hd)) for n in rows}
    mx.eval(list(q.values()), list(k.values()))

    def metadata(n: int) -> AttentionMetadata:
        ctx = list(range(context + 1, context + 1 + n))
        return AttentionMetadata.build([1] * n, ctx, [table] * n, bs)

    def forward(n: int) -> None:
        logits = model(
            mx.array([5] * n, dtype=mx.int32),
            mx.arange(context, context + n, dtype=mx.int32),
            metadata(n),
            cache,
            logits_indices=mx.arange(n, dtype=mx.int32),
        )
        mx.eval(logits, cache.arrays())

    def attention(n: int) -> None:
        md, outs = metadata(n), []
        for i in range(len(layers)):
            cache.keys[i], cache.values[i] = ops.write_kv(
                cache.keys[i], cache.values[i], k[n], k[n], md.slot_mapping
            )
            outs.append(ops.paged_attention(q[n], cache.keys[i], cache.values[i], md, attn.scale))
        mx.eval(outs, cache.arrays())

    results: dict = {}
    for name, fn in (("forward", forward), ("attention", attention)):
        wall = dict.fromkeys(rows, float("inf"))
        cpu = dict.fromkeys(rows, float("inf"))
        for _ in range(2):
            for n in rows:
                fn(n)
        for _ in range(repeats):
            for n in rows:
                t, c = time.perf_counter(), time.process_time()
                fn(n)
                wall[n] = min(wall[n], time.perf_counter() - t)
                cpu[n] = min(cpu[n], time.process_time() - c)
        for n in rows:
            results.setdefault(n, {})[name] = {
                "ms": wall[n] * 1000,
                "cpu_ms": cpu[n] * 1000,
                "vs_1_row": wall[n] / wall[rows[0]],
            }
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mlxserve bench profile", description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8], help="none: skip")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--overlap-rounds",
        type=int,
        default=3,
        help="rounds of the exposed-host-time measurement (async scheduling on / off); 0: skip",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--ops", action="store_true", help="print each step's ops by primitive (a histogram)"
    )
    ap.add_argument(
        "--verify-rows",
        type=int,
        nargs="*",
        default=[1, 2, 5, 8],
        help="forward passes over this many decode rows of one request (speculative "
        "verification); none: skip",
    )
    ap.add_argument(
        "--verify-context", type=int, default=60, help="tokens cached before the verified rows"
    )
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    engine = make_engine(args.model, max_num_seqs=max(64, *args.batch, 1))
    results: dict[str, object] = {"load_start": load, "steps": {}, "parts": {}}
    for b in args.batch:
        histogram: dict[str, int] = {}
        was_async, engine.async_scheduling = engine.async_scheduling, False  # see 1.
        ms = profile_engine(engine, b, args.steps, histogram)
        engine.async_scheduling = was_async
        results["steps"][b] = ms
        results.setdefault("ops", {})[b] = histogram
        print(
            f"\nbatch {b}: step {ms['step']:.1f} ms = host {ms['host']:.1f} ms "
            f"({ms['host'] / ms['step']:.0%}) + eval {ms.get('eval', 0):.1f} ms; "
            f"{ms['ops']:.0f} ops evaluated; CPU time {ms['cpu']:.1f} ms"
        )
        for k in sorted(ms):
            if k not in ("step", "host", "eval", "ops", "cpu"):
                print(f"  {k:28s} {ms[k]:7.2f} ms")
        if args.ops:
            print("  ops by primitive:")
            for name, n in histogram.items():
                print(f"  {name:36s} {n:5d}")
        if args.overlap_rounds:
            overlap = profile_overlap(engine, b, args.steps, args.overlap_rounds)
            results.setdefault("overlap", {})[b] = overlap
            compute = overlap.pop("eval")["step"]
            overlap["compute"] = compute
            print(
                f"  real engine loop, median of {args.overlap_rounds} rounds (eval-only "
                f"compute of the same steps {compute:.1f} ms):"
            )
            for mode, o in list(overlap.items())[:2]:
                exposed = o["step"] - compute
                o["exposed_host"], o["host_share"] = exposed, exposed / o["step"]
                print(
                    f"  {mode:5s} scheduling: step {o['step']:6.1f} ms, exposed host "
                    f"{exposed:5.1f} ms ({exposed / o['step']:.0%}), CPU time {o['cpu']:.1f} ms"
                )
        parts = profile_parts(engine.runner.model, b, args.repeats)
        results["parts"][b] = parts
        print(f"  parts alone (best of {args.repeats}):")
        for k, v in parts.items():
            print(f"  {k:36s} {v:7.2f}")
    if args.verify_rows:
        verify = profile_verification(
            engine.runner.model, args.verify_rows, args.repeats, args.verify_context
        )
        results["verification"] = verify
        print(
            f"\nn decode rows of one request after {args.verify_context} cached tokens "
            "(speculative verification), best wall ms (x one row) / CPU ms:"
        )
        for n, v in verify.items():
            f, a = v["forward"], v["attention"]
            print(
                f"  {n} rows: forward {f['ms']:.1f} ({f['vs_1_row']:.2f}x) / {f['cpu_ms']:.1f}"
                f"  attention {a['ms']:.1f} ({a['vs_1_row']:.2f}x) / {a['cpu_ms']:.1f}"
            )
    results["load_end"] = os.getloadavg()[0]
    print(f"\nload average: {load:.2f} at start, {results['load_end']:.2f} at end")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
