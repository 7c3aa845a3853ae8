"""The fused CPU layer primitives (mlxserve/cpu/layer.py, csrc/layer_ext.cpp) and the
one-op stack of layers (mlxserve/cpu/stack.py, csrc/decoder_stack_ext.cpp).

Oracles: the same model with the one-op stack switched off (one op per layer), with the
one-op layer switched off too (its two halves around the separate K/V write and attention:
5 ops) and with every fused part off (the separate CPU primitives: the same kernels in the
same order, so bit for bit, pools included), and with
the pure-MLX fallback forced (MLX's own norm, RoPE, SwiGLU, K/V quantization and attention:
within float32 tolerance). Every run has a prefill chunk, decodes over a prefix already in
the pool (one padded), a prefill beside a decode and a verification's rows, so the
primitives see any row count.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxserve import ops
from mlxserve.cpu import kernels as cpu
from mlxserve.cpu import layer as cpu_layer
from mlxserve.cpu import ops as cpu_ops
from mlxserve.cpu import stack as cpu_stack
from mlxserve.loader import load_model
from mlxserve.models import KVCache
from mlxserve.models.fused import fuse_projections
from mlxserve.ops import AttentionMetadata, kv_quant
from mlxserve.worker.pool_watch import buffer_address
from tests.model_helpers import BlockPoolRunner, make_mlx_lm_checkpoint, tiny_config

pytestmark = pytest.mark.skipif(not cpu.available(), reason="mlxserve's CPU kernels not built")

# llama: no biases; qwen2: q/k/v biases; qwen3: per-head q/k norms before RoPE.
MODELS = {
    "llama": tiny_config("llama", num_hidden_layers=2),
    "qwen2": tiny_config("qwen2", num_hidden_layers=2),
    "qwen3": tiny_config("qwen3", num_hidden_layers=2, head_dim=16),
}


def quantized_checkpoints(root: Path, models: dict, seed: int) -> dict[str, Path]:
    """Each config of ``models`` as a 4-bit (group 32) mlx-lm checkpoint under ``root``."""
    quantize = {"group_size": 32, "bits": 4}
    return {
        name: make_mlx_lm_checkpoint(root / name, config, seed=seed, quantize=quantize)[1]
        for name, config in models.items()
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return quantized_checkpoints(tmp_path_factory.mktemp("cpu_layer"), MODELS, seed=5)


def _load(path: Path, act_bits: int) -> nn.Module:
    """As the engine loads it on the CPU: kernels, then fused projections."""
    model = load_model(str(path), skip_tokenizer_init=True).model
    fuse_projections(model)
    for _, m in model.named_modules():
        if isinstance(m, cpu.CpuQuantizedLinear | cpu.CpuQuantizedEmbedding):
            m.act_bits = act_bits  # what MLXSERVE_CPU_INT8 sets at load
    return model


def _run(model: nn.Module, kv_dtype: mx.Dtype = mx.float32) -> tuple[list, list]:
    """Logits of a prefill, batched decodes (one padded), a verification; then the pools."""
    runner = BlockPoolRunner(model, num_blocks=32, block_size=4, dtype=kv_dtype)
    logits = [runner.step([("a", list(range(3, 14)))], all_logits=True)["a"]]
    for i in range(2):
        out = runner.step([("a", [20 + i]), ("b", [5, 6, 7] if i == 0 else [30])], pad_to=4)
        logits += [out["a"], out["b"]]
    logits.append(runner.step([("a", [40, 41, 42, 43])], all_logits=True)["a"])  # 4 rows
    pools = [np.array(p) for p in runner.cache.keys + runner.cache.values]
    return logits, pools


FUSED = ("decoder_stack", "decoder_layer", "attention_input", "output_mlp", "embed")
LAYERS = ("decoder_stack",)  # switched off: one op per layer


class _Spy:
    """Counts the fused parts a forward pass used (returns other than None); the parts in
    ``off`` return None (the model then builds the graph they replace)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, off: tuple[str, ...] = ()) -> None:
        self.used = dict.fromkeys(FUSED, 0)
        for name in self.used:
            owner = cpu_stack if name == "decoder_stack" else cpu_layer
            real = getattr(owner, name)

            def spy(*args, _real=real, _name=name):
                out = None if _name in off else _real(*args)
                self.used[_name] += out is not None
                return out

            monkeypatch.setattr(owner, name, spy)


def _assert_same_bits(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("act_bits", [0, 8], ids=["float", "int8"])
@pytest.mark.parametrize("model_type", list(MODELS))
def test_fused_layers_give_the_separate_primitives_bits(
    checkpoints: dict[str, Path], model_type: str, act_bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _load(checkpoints[model_type], act_bits)
    runs = {}
    halves = {"decoder_stack": 0, "decoder_layer": 0, "attention_input": 8, "output_mlp": 8}
    for label, off, used in [
        ("stack", (), {"decoder_stack": 4, "decoder_layer": 0, "attention_input": 0}),
        ("layers", LAYERS, {"decoder_stack": 0, "decoder_layer": 8, "attention_input": 0}),
        ("halves", (*LAYERS, "decoder_layer"), halves),
        ("separate", FUSED, dict.fromkeys(FUSED, 0)),
    ]:  # 2 layers, 4 passes
        with monkeypatch.context() as m:
            spy = _Spy(m, off)
            runs[label] = _run(model)
        assert {k: spy.used[k] for k in used} == used, label
    fused_logits, fused_pools = runs["stack"]
    for label in ("layers", "halves", "separate"):
        _assert_same_bits(fused_logits + fused_pools, runs[label][0] + runs[label][1])
    with ops.force_backend("fallback"):  # MLX's ops (the quantized matmuls stay the kernels)
        spy = _Spy(monkeypatch)
        ref_logits, ref_pools = _run(model)
    assert spy.used == dict.fromkeys(FUSED, 0)
    for got, want in zip(fused_logits + fused_pools, ref_logits + ref_pools, strict=True):
        if act_bits == 0:
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
        else:  # MLX's ops differ in the last bits, and int8 rounding moves near ties a step
            assert np.linalg.norm(got - want) <= 0.05 * np.linalg.norm(want)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_one_op_layer_quantizes_int8_pools_as_the_separate_ops(
    checkpoints: dict[str, Path], model_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8 pools: the one-op stack's and layer's rows and scales are kv_quant.quantize's
    (MLX's ops), byte for byte; the fallback's attention over them agrees within float32
    tolerance."""
    model = _load(checkpoints[model_type], 0)
    with monkeypatch.context() as m:
        spy = _Spy(m)
        logits, pools = _run(model, mx.int8)
    assert spy.used["decoder_stack"] == 4
    for off, used in [(LAYERS, "decoder_layer"), ((*LAYERS, "decoder_layer"), "output_mlp")]:
        with monkeypatch.context() as m:
            spy = _Spy(m, off)
            _assert_same_bits(logits + pools, [a for part in _run(model, mx.int8) for a in part])
        assert spy.used[used] == 8
    with ops.force_backend("fallback"):
        ref_logits, ref_pools = _run(model, mx.int8)
    for got, want in zip(logits, ref_logits, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-3)
    for got, want in zip(pools, ref_pools, strict=True):
        got, want = (kv_quant.dequantize(mx.array(p), mx.float32) for p in (got, want))
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-2, rtol=1e-4)


@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_embedding_rows_are_mlx_s_dequantized_rows(scale_dtype: mx.Dtype) -> None:
    """Oracle: MLX's mx.dequantize of the gathered rows (CpuQuantizedEmbedding's lookup)."""
    table = mx.random.normal((50, 192), key=mx.random.key(4))
    ids = mx.array([7, 0, 49, 7, 13], dtype=mx.int32)
    for bits in cpu.BITS:
        for group_size in (32, 64):
            layer = nn.QuantizedEmbedding.from_embedding(nn.Embedding(50, 192), group_size, bits)
            w, scales, biases = mx.quantize(table, group_size=group_size, bits=bits)
            layer.update({"weight": w, "scales": scales.astype(scale_dtype)})
            layer.update({"biases": biases.astype(scale_dtype)})
            layer = _as_kernel_layer(layer)
            got = cpu_layer.embed(layer, ids)
            assert got is not None and got.dtype == mx.float32
            assert mx.array_equal(got, layer(ids)).item(), (bits, group_size)
    # An id outside the table (the engine rejects those first): zeros, not a crash.
    out = cpu.module().embed_rows(mx.array([3, 50, -1]), w, scales, biases, group_size, bits)
    assert mx.array_equal(out[1:], mx.zeros((2, 192))).item()


def _as_kernel_layer(layer: nn.Module) -> nn.Module:
    holder = nn.Module()
    holder.embed = layer
    assert cpu.use_kernels(holder) == 1
    return holder.embed


@pytest.mark.parametrize("kv_dtype", [mx.float32, mx.int8], ids=["float-pool", "int8-pool"])
def test_fused_layers_write_the_pools_in_place(
    checkpoints: dict[str, Path], kv_dtype: mx.Dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-op stack, the one-op layer and the halves' scatter (k and v in its shape: no
    Reshape op) all write the pools in place: every step's pools are the first step's
    buffers."""
    model = _load(checkpoints["llama"], 0)
    for off, used, count in [
        ((), "decoder_stack", 4),
        (LAYERS, "decoder_layer", 8),
        ((*LAYERS, "decoder_layer"), "attention_input", 8),
    ]:
        with monkeypatch.context() as m:
            spy = _Spy(m, off)
            runner = BlockPoolRunner(model, num_blocks=16, block_size=4, dtype=kv_dtype)
            addresses = []
            for tokens in ([3, 4, 5, 6, 7], [8], [9], [10, 11, 12]):
                runner.step([("a", tokens)])
                # (no name for the pools list: holding the arrays would force a copy)
                addresses.append([buffer_address(a) for a in runner.cache.arrays()])
        assert spy.used[used] == count
        assert addresses[1:] == addresses[:-1], used  # every step wrote the same buffers
    with ops.force_backend("fallback"):
        reference = BlockPoolRunner(model, num_blocks=16, block_size=4, dtype=kv_dtype)
        for tokens in ([3, 4, 5, 6, 7], [8], [9], [10, 11, 12]):
            reference.step([("a", tokens)])
    atol = 1e-5
    for got, want in zip(runner.cache.keys, reference.cache.keys, strict=True):
        if kv_dtype == mx.int8:  # rows and their scales: compare what they hold (a quantum)
            got, want = kv_quant.dequantize(got, mx.float32), kv_quant.dequantize(want, mx.float32)
            atol = 2e-2
        np.testing.assert_allclose(np.array(got), np.array(want), atol=atol, rtol=1e-4)


@pytest.mark.parametrize(("off", "used"), [((), "decoder_stack"), (LAYERS, "decoder_layer")])
def test_a_held_pool_is_copied_not_overwritten(
    checkpoints: dict[str, Path], off: tuple[str, ...], used: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While something else holds old pools (a stray reference: all of them, or one), the
    one-op stack and layer write copies of those: the held arrays keep their contents, the
    others are written in place, the results are the in-place run's."""
    model = _load(checkpoints["llama"], 0)
    spy = _Spy(monkeypatch, off)
    runs = []
    for hold in ("none", "all", "one"):
        runner = BlockPoolRunner(model, num_blocks=16, block_size=4)
        logits = []
        for tokens in ([3, 4, 5, 6, 7], [8], [9, 10]):
            arrays = runner.cache.arrays()
            held = {"none": [], "all": arrays, "one": arrays[3:4]}[hold]
            free = [buffer_address(a) for a in arrays if all(a is not h for h in held)]
            before = [np.array(a) for a in held]
            del arrays
            logits.append(runner.step([("a", tokens)])["a"])
            _assert_same_bits([np.array(a) for a in held], before)
            now = [buffer_address(a) for a in runner.cache.arrays()]
            assert all(buffer_address(a) not in now for a in held)
            assert sorted(free) == sorted(a for a in now if a in free)  # the rest: in place
            del held
        runs.append(logits + [np.array(a) for a in runner.cache.arrays()])
    assert spy.used[used] == (6 if used == "decoder_layer" else 3) * 3
    _assert_same_bits(runs[1], runs[0])
    _assert_same_bits(runs[2], runs[0])


@pytest.mark.parametrize("model_type", list(MODELS))
def test_a_decode_layer_is_one_op(
    checkpoints: dict[str, Path], model_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One layer's graph, its inputs (and the step's RoPE tables and slots) evaluated: one
    op, or 5 where the whole layer does not apply but its halves do."""
    from bench.decode_profile import op_histogram

    model = _load(checkpoints[model_type], 0)
    layer = model.model.layers[0]
    md = AttentionMetadata.build([1, 1], [3, 6], [[1], [2, 3]], 4)
    x = mx.random.normal((2, model.args.hidden_size), key=mx.random.key(2))
    positions = mx.array([2, 5])
    steps = (
        layer.self_attn.rope.tables(positions, mx.float32),
        cpu_ops._block_offsets(md.slot_mapping, 4),
        cpu_ops.step_rows(md),
    )
    five = {
        "Scatter": 2,  # K and V, no Reshape before them
        "MlxserveCpuAttentionInput": 1,
        "MlxserveCpuOutputMlp": 1,
        "MlxserveCpuPagedAttention": 1,
    }
    for off, want in [((), {"MlxserveCpuDecoderLayer": 1}), (("decoder_layer",), five)]:
        cache = KVCache.allocate_for(model, 8, 4, mx.float32)
        mx.eval(x, cache.arrays(), steps)
        with monkeypatch.context() as m:
            _Spy(m, off)
            out = layer(x, positions, md, cache)
        assert op_histogram([out, *cache.arrays()]) == want


def test_layers_off_the_kernels_keep_the_separate_ops(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _load(checkpoints["llama"], 0)
    layer = model.model.layers[0]
    x = mx.random.normal((3, model.args.hidden_size), key=mx.random.key(1))
    attn_out = mx.zeros((3, layer.self_attn.num_heads, layer.self_attn.head_dim))
    positions = mx.array([0, 1, 2])
    assert cpu_layer.output_mlp(layer, x, attn_out) is not None
    # Activations other than float32: the primitives are float32 only.
    assert cpu_layer.output_mlp(layer, x.astype(mx.float16), attn_out) is None
    # A linear that is not the kernels' (e.g. a tensor-parallel shard's wrapper).
    down = layer.mlp.down_proj
    layer.mlp.down_proj = nn.Linear(model.args.intermediate_size, model.args.hidden_size)
    assert cpu_layer.output_mlp(layer, x, attn_out) is None
    layer.mlp.down_proj = down
    # Unfused gate/up projections (fusion refused: e.g. their settings differ).
    unfused = load_model(str(checkpoints["llama"]), skip_tokenizer_init=True).model
    unfused_layer = unfused.model.layers[0]
    assert cpu_layer.output_mlp(unfused_layer, x, attn_out) is None
    args = (unfused_layer.self_attn, unfused_layer.input_layernorm, x, positions)
    assert cpu_layer.attention_input(*args) is None
    md = AttentionMetadata.build([3], [3], [[1]], 4)
    whole = (x, positions, md)
    unfused_cache = KVCache.allocate_for(unfused, 4, 4, mx.float32)
    assert cpu_layer.decoder_layer(unfused_layer, *whole, unfused_cache) is None
    # Pools the one op does not write (float16): the halves around MLX's scatter.
    float16_cache = KVCache.allocate_for(model, 4, 4, mx.float16)
    assert cpu_layer.decoder_layer(layer, *whole, float16_cache) is None
    assert cpu_layer.attention_input(layer.self_attn, layer.input_layernorm, x, positions)
    # MLXSERVE_CPU_KERNELS=off / kernels="fallback" leave ops.cpu_module() None.
    with ops.force_backend("fallback"):
        assert cpu_layer.output_mlp(layer, x, attn_out) is None
        cache = KVCache.allocate_for(model, 4, 4, mx.float32)
        assert cpu_layer.decoder_layer(layer, *whole, cache) is None
    monkeypatch.setattr(ops, "cpu_module", lambda: None)
    assert cpu_layer.output_mlp(layer, x, attn_out) is None
    assert cpu_layer.attention_input(layer.self_attn, layer.input_layernorm, x, positions) is None


def test_primitives_reject_inconsistent_shapes(checkpoints: dict[str, Path]) -> None:
    model = _load(checkpoints["llama"], 0)
    layer = model.model.layers[0]
    attn, module = layer.self_attn, cpu.module()
    qkv = attn.qkv_proj
    hidden = model.args.hidden_size

    def call(**changed):
        args = {
            "x": mx.zeros((2, hidden)),
            "norm_weight": layer.input_layernorm.weight,
            "eps": 1e-5,
            "qkv": [qkv.weight, qkv.scales, qkv.biases],
            "qkv_settings": [qkv.group_size, qkv.bits, 0],
            "cos": mx.zeros((2, 1, attn.head_dim // 2)),
            "sin": mx.zeros((2, 1, attn.head_dim // 2)),
            "heads": [4, 2, 2],
            "head_dims": [16] * 3,
            "rotated": 2,
            "traditional": False,
        }
        return module.attention_input(**(args | changed))

    assert [a.shape for a in call()] == [(2, 4, 16), (2, 2, 16), (2, 2, 16)]
    with pytest.raises(ValueError, match="must add up to the projection's 128 outputs"):
        call(heads=[4, 4, 2])
    with pytest.raises(ValueError, match="w holds rows of 64 values, the input has 32"):
        call(x=mx.zeros((2, 32)), norm_weight=mx.ones((32,)))
    with pytest.raises(ValueError, match="x must be \\(tokens, hidden\\) float32"):
        call(x=mx.zeros((2, hidden), dtype=mx.float16))
    with pytest.raises(ValueError, match="act_bits must be 0 or 8"):
        call(qkv_settings=[qkv.group_size, qkv.bits, 4])
    with pytest.raises(ValueError, match="qk_norms must be \\[\\] or \\[q, k\\]"):
        call(qk_norms=[mx.ones((16,))])
    with pytest.raises(ValueError, match="qk_norms must be \\(head_dim,\\)"):
        call(qk_norms=[mx.ones((16,)), mx.ones((8,))])
    with pytest.raises(ValueError, match="cos and sin must be"):
        call(cos=mx.zeros((3, 1, attn.head_dim // 2)))


def _t_frac(g: np.ndarray) -> np.ndarray:
    """The fraction of exp's t = |g| * 1.442695f (float32), NaN where t is not finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (np.abs(g) * np.float32(1.442695)) % np.float32(1)


def _swiglu_inputs(hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """Gate values over exp's whole range with its edge cases, and random up values."""
    rng = np.random.default_rng(3)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 88.0, -88.0, 87.9, 88.1, 1e-40, -1e-40]
    special += [60.9, -60.9, 1e30, -1e30, np.float32(np.finfo(np.float32).max)]
    # floor(t + 0.5) at ties: gates whose t = |g| * 1.442695f is k + 1/2 exactly
    ties = []
    for k in range(-40, 40):
        g = np.float32((k + 0.5) / 1.442695)
        for step in range(-3, 4):
            c = np.nextafter(g, np.float32(np.inf * step)) if step else g
            if _t_frac(c) == np.float32(0.5):
                ties.append(c)
    wide = rng.standard_normal(hidden * 3) * np.float32(10.0)
    g = np.concatenate([np.array(special + ties, np.float32), wide.astype(np.float32)])
    g = np.resize(g, 3 * hidden).astype(np.float32)  # 3 rows
    up = rng.standard_normal(3 * hidden).astype(np.float32)
    return g.reshape(3, hidden), up.reshape(3, hidden)


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("hidden", [1536, 37])  # 37: an odd tail after the vectors
def test_swiglu_is_mlx_s_bit_for_bit(isa: str, hidden: int) -> None:
    """The fused MLP's SwiGLU (csrc/swiglu.c) against MLX's own silu(g) * up: every bit,
    at exp's edges (NaN, infinities, +-88, floor's ties) and on the vector path's tail."""
    from mlxserve.models.compiled import swiglu

    g, up = _swiglu_inputs(hidden)
    ties = _t_frac(g) == np.float32(0.5)
    assert ties.sum() >= 20, "the inputs must reach floor(t + 0.5)'s ties"
    want = np.array(swiglu(mx.array(g), mx.array(up)))
    lib = ctypes.CDLL(str(cpu.info()["path"]))
    pointer, count = ctypes.c_void_p, ctypes.c_int64
    lib.mlxserve_swiglu.argtypes = [pointer, count, count, pointer]
    gu = np.ascontiguousarray(np.concatenate([g, up], axis=1))  # (rows, 2 * hidden) = [g | up]
    got = np.full_like(g, 7.0)
    module = cpu.module()
    assert module.force_isa(isa)
    try:
        lib.mlxserve_swiglu(gu.ctypes.data, g.shape[0], hidden, got.ctypes.data)
    finally:
        module.force_isa("auto")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))
