"""The one-op stack of decoder layers (mlxserve/cpu/stack.py, csrc/decoder_stack_ext.cpp).

Oracles: the same model with the stack switched off (one op per layer: the same functions
in the same order, so the same bits, pools included) and the pure-MLX fallback (MLX's own
norm, RoPE, SwiGLU, K/V quantization and attention: within float32 tolerance). The steps
hold one row, many decode rows, prefill chunks over a prefix, and decodes beside prefills.
tests/test_cpu_layer.py compares the stack too, on its runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlxserve import ops
from mlxserve.cpu import kernels as cpu
from mlxserve.cpu import ops as cpu_ops
from mlxserve.cpu import stack as cpu_stack
from mlxserve.models import KVCache, llama
from mlxserve.ops import AttentionMetadata, kv_quant
from tests.model_helpers import BlockPoolRunner, tiny_config
from tests.test_cpu_layer import LAYERS, _assert_same_bits, _load, _Spy, quantized_checkpoints

pytestmark = pytest.mark.skipif(not cpu.available(), reason="mlxserve's CPU kernels not built")

MODELS = {
    "llama": tiny_config("llama", num_hidden_layers=3),
    "qwen3": tiny_config("qwen3", num_hidden_layers=3, head_dim=16),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return quantized_checkpoints(tmp_path_factory.mktemp("cpu_stack"), MODELS, seed=7)


def _many_rows(model: nn.Module, kv_dtype: mx.Dtype) -> list[np.ndarray]:
    """Logits of: a prefill in two chunks, one decode row, six prompts beside a decode, three
    steps of seven decode rows (one padded), decodes beside a new prompt's chunk; then the
    pools."""
    runner = BlockPoolRunner(model, num_blocks=48, block_size=4, dtype=kv_dtype)
    out = [runner.step([("a", list(range(3, 12)))], all_logits=True)["a"]]
    out.append(runner.step([("a", list(range(12, 19)))], all_logits=True)["a"])
    out.append(runner.step([("a", [19])])["a"])
    prompts = [(f"r{i}", list(range(30 + i, 33 + 2 * i))) for i in range(6)]
    step = runner.step([("a", [20]), *prompts])
    out += [step[r] for r in ("a", *(p[0] for p in prompts))]
    for i in range(3):
        work = [(r, [40 + i]) for r in ("a", *(p[0] for p in prompts))]
        step = runner.step(work, pad_to=8 if i == 1 else None)
        out += [step[r] for r, _ in work]
    step = runner.step([("a", [50]), ("r0", [51]), ("z", list(range(60, 70)))], all_logits=True)
    out += [step["a"], step["r0"], step["z"]]
    return out + [np.array(p) for p in runner.cache.keys + runner.cache.values]


@pytest.mark.parametrize("kv_dtype", [mx.float32, mx.int8], ids=["float-pool", "int8-pool"])
@pytest.mark.parametrize("model_type", list(MODELS))
def test_the_stack_gives_the_layer_ops_bits_at_any_row_count(
    checkpoints: dict[str, Path],
    model_type: str,
    kv_dtype: mx.Dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _load(checkpoints[model_type], 0)
    with monkeypatch.context() as m:
        spy = _Spy(m)
        stack = _many_rows(model, kv_dtype)
    assert spy.used["decoder_stack"] == 8 and spy.used["decoder_layer"] == 0
    with monkeypatch.context() as m:
        spy = _Spy(m, LAYERS)
        layers = _many_rows(model, kv_dtype)
    assert spy.used["decoder_stack"] == 0 and spy.used["decoder_layer"] == 24
    _assert_same_bits(stack, layers)
    with ops.force_backend("fallback"):  # MLX's ops (the quantized matmuls stay the kernels)
        reference = _many_rows(model, kv_dtype)
    num_pools = 2 * MODELS[model_type]["num_hidden_layers"]
    for got, want in zip(stack[:-num_pools], reference[:-num_pools], strict=True):
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-3)
    for got, want in zip(stack[-num_pools:], reference[-num_pools:], strict=True):
        if kv_dtype == mx.int8:  # rows and their scales: compare what they hold (a quantum)
            got, want = (
                np.array(kv_quant.dequantize(mx.array(p), mx.float32)) for p in (got, want)
            )
        np.testing.assert_allclose(got, want, atol=2e-2 if kv_dtype == mx.int8 else 1e-5)


def _layer(model: nn.Module, i: int) -> nn.Module:
    return model.model.layers[i]


def _scale_array(model: nn.Module, name: str, factor: float) -> list[tuple[str, mx.array]]:
    value = dict(tree_flatten(model.parameters()))[name]
    return [(name, (value.astype(mx.float32) * factor).astype(value.dtype))]


def _update(model: nn.Module) -> None:  # nn.Module.update with one array replaced
    model.update(tree_unflatten(_scale_array(model, "model.layers.1.mlp.down_proj.scales", 2)))


def _load_weights(model: nn.Module) -> None:
    model.load_weights(_scale_array(model, "model.layers.0.self_attn.qkv_proj.scales", 0.5), False)


def _set_attribute(model: nn.Module) -> None:
    norm = _layer(model, 2).input_layernorm
    norm.weight = norm.weight * 1.5


def _swap_modules(model: nn.Module) -> None:  # (update_modules: the parents' items replaced)
    mlp0, mlp2 = _layer(model, 0).mlp, _layer(model, 2).mlp
    model.update_modules(
        tree_unflatten([("model.layers.0.mlp", mlp2), ("model.layers.2.mlp", mlp0)])
    )


def _set_setting(model: nn.Module) -> None:  # a layer's settings, not its arrays
    _layer(model, 1).mlp.gate_up_proj.act_bits = 8


def _new_layers(model: nn.Module) -> None:  # the stack's list, an item replaced
    layer = _layer(_load(model.path, 0), 1)
    layer.self_attn.rope = _layer(model, 0).self_attn.rope  # (the stack's layers share one)
    layer.mlp = _layer(model, 0).mlp
    model.model.layers[1] = layer


CHANGES = [_update, _load_weights, _set_attribute, _swap_modules, _set_setting, _new_layers]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__[1:] for c in CHANGES])
def test_the_stack_runs_the_weights_the_model_has_now(
    checkpoints: dict[str, Path], change, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change between steps (weights replaced, modules moved, a setting, another layer):
    the next step's logits are those of the layers one by one (they read the modules each
    step), and differ from the unchanged model's; the kept arguments are made once per
    change, not per step."""
    path = checkpoints["llama"]

    def run(stack: bool, changed: bool) -> list[np.ndarray]:
        model = _load(path, 0)
        model.path = path  # (for _new_layers)
        with monkeypatch.context() as m:
            spy = _Spy(m, () if stack else LAYERS)
            runner = BlockPoolRunner(model, num_blocks=16, block_size=4)
            out = [runner.step([("a", [3, 4, 5, 6, 7])])["a"], runner.step([("a", [8])])["a"]]
            if changed:
                change(model)
            out += [runner.step([("a", [9])])["a"], runner.step([("a", [10, 11])])["a"]]
        if stack:
            assert spy.used["decoder_stack"] == 4
            assert model.model._stack_args.num_made == (2 if changed else 1)
        return out + [np.array(a) for a in runner.cache.arrays()]

    got = run(stack=True, changed=True)
    _assert_same_bits(got, run(stack=False, changed=True))
    unchanged = run(stack=True, changed=False)
    _assert_same_bits(got[:2], unchanged[:2])
    assert not np.array_equal(got[2], unchanged[2])


def _step_inputs(model: nn.Module, num_pools: int, kv_dtype: mx.Dtype = mx.float32):
    md = AttentionMetadata.build([1, 2], [3, 6], [[1], [2, 3]], 4)
    x = mx.random.normal((3, model.args.hidden_size), key=mx.random.key(2))
    cache = KVCache.allocate_layers([(2, 16, 16)] * num_pools, 8, 4, kv_dtype)
    return x, mx.array([2, 4, 5]), md, cache


def test_the_stack_applies_only_where_every_layer_op_would(checkpoints: dict[str, Path]) -> None:
    model = _load(checkpoints["llama"], 0)
    layers = model.model.layers
    args = cpu_stack.StackArgs()
    x, positions, md, cache = _step_inputs(model, 3)
    assert cpu_stack.decoder_stack(args, layers, x, positions, md, cache) is not None
    # Activations other than float32, 16-bit pools, a pool per layer missing or extra,
    # int64 slots, the fallback forced, kernels off.
    half = x.astype(mx.float16)
    assert cpu_stack.decoder_stack(args, layers, half, positions, md, cache) is None
    for pools, dtype in [(3, mx.float16), (2, mx.float32), (4, mx.float32)]:
        other = _step_inputs(model, pools, dtype)[3]
        assert cpu_stack.decoder_stack(args, layers, x, positions, md, other) is None
    md64 = dataclasses.replace(md, slot_mapping=md.slot_mapping.astype(mx.int64))
    assert cpu_stack.decoder_stack(args, layers, x, positions, md64, cache) is None
    with ops.force_backend("fallback"):
        assert cpu_stack.decoder_stack(args, layers, x, positions, md, cache) is None
    # A layer whose attention is another's (a subclass attending its own way).
    attn = layers[1].self_attn

    class OtherAttention(llama.Attention):
        def attend(self, qkv, md, cache):
            return super().attend(qkv, md, cache)

    attn.__class__ = OtherAttention
    assert cpu_stack.decoder_stack(args, layers, x, positions, md, cache) is None
    attn.__class__ = llama.Attention
    assert cpu_stack.decoder_stack(args, layers, x, positions, md, cache) is not None
    # A linear layer off the kernels (a tensor-parallel shard's wrapper), unfused layers.
    down = layers[2].mlp.down_proj
    layers[2].mlp.down_proj = nn.Linear(model.args.intermediate_size, model.args.hidden_size)
    assert cpu_stack.decoder_stack(args, layers, x, positions, md, cache) is None
    layers[2].mlp.down_proj = down
    assert cpu_stack.decoder_stack(args, layers, x, positions, md, cache) is not None
    # Weights the checks refuse: an error, and nothing kept from before.
    norm = layers[0].input_layernorm
    weight, norm.weight = norm.weight, mx.ones((7,))
    with pytest.raises(ValueError, match="the input has 7"):
        cpu_stack.decoder_stack(args, layers, x, positions, md, cache)
    assert args.layers is None and not args.current(layers)
    norm.weight = weight
    assert cpu_stack.decoder_stack(args, layers, x, positions, md, cache) is not None
    unfused = llama.Model(llama.ModelArgs.from_dict(MODELS["llama"]))
    other = cpu_stack.StackArgs()
    assert cpu_stack.decoder_stack(other, unfused.model.layers, x, positions, md, cache) is None


def test_a_pipeline_stage_s_layers_are_one_op(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last two layers alone, their pools at 0 and 1 (as a pipeline stage holds them):
    one op, the bits of those layers one by one; their own indices (the whole model's)
    leave them to the layer ops."""
    model = _load(checkpoints["llama"], 0)
    stage = model.model.layers[1:]
    x, positions, md, _ = _step_inputs(model, 2)
    args = cpu_stack.StackArgs()
    assert cpu_stack.decoder_stack(args, stage, x, positions, md, _step_inputs(model, 2)[3]) is None
    for i, layer in enumerate(stage):
        layer.self_attn.layer_idx = i
    from bench.decode_profile import op_histogram

    step = (stage[0].self_attn.rope.tables(positions, mx.float32), cpu_ops.step_rows(md))
    runs = []
    for use_stack in (True, False):
        cache = _step_inputs(model, 2)[3]
        mx.eval(x, cache.arrays(), step)
        if use_stack:
            h = cpu_stack.decoder_stack(args, stage, x, positions, md, cache)
            assert op_histogram([h, *cache.arrays()]) == {"MlxserveCpuDecoderStack": 1}
        else:
            h = x
            for layer in stage:
                h = layer(h, positions, md, cache)
        runs.append([np.array(a) for a in (h, *cache.arrays())])
    _assert_same_bits(runs[0], runs[1])


def test_stack_layers_reject_inconsistent_shapes(checkpoints: dict[str, Path]) -> None:
    model = _load(checkpoints["llama"], 0)
    layer, module = _layer(model, 0), cpu.module()
    attn, mlp = layer.self_attn, layer.mlp

    def arrays(linear: nn.Module) -> list[mx.array]:
        return [linear.weight, linear.scales, linear.biases]

    def make(**changed):
        settings = [32, 4, 0]
        args = {
            "norm_weight": layer.input_layernorm.weight, "eps": 1e-5,
            "qkv": arrays(attn.qkv_proj), "qkv_settings": settings, "num_heads": 4,
            "num_kv_heads": 2, "head_dim": 16, "rope_dims": 16, "traditional": False,
            "qk_norms": [], "qk_eps": 0.0, "scale": 0.25, "o": arrays(attn.o_proj),
            "o_settings": settings, "post_norm_weight": layer.post_attention_layernorm.weight,
            "post_eps": 1e-5, "gate_up": arrays(mlp.gate_up_proj), "gate_up_settings": settings,
            "down": arrays(mlp.down_proj), "down_settings": settings,
        }  # fmt: skip
        return module.stack_layer(**(args | changed))

    stack = module.decoder_stack_layers([make(), make()])
    with pytest.raises(ValueError, match="must add up to the projection's 128 outputs"):
        make(num_heads=6)
    with pytest.raises(ValueError, match="rope_dims must be even"):
        make(rope_dims=15)
    with pytest.raises(ValueError, match="hidden sizes and rope_dims must be alike"):
        module.decoder_stack_layers([make(), make(rope_dims=8)])
    x, positions, md, cache = _step_inputs(model, 2)
    cos, sin = attn.rope.tables(positions, mx.float32)
    call = [x, cos, sin, md.slot_mapping, md.block_tables, md.context_lens, 2]
    assert len(module.decoder_stack(stack, *call, cache.keys, cache.values)) == 5
    with pytest.raises(ValueError, match="one K and one V pool per layer"):
        module.decoder_stack(stack, *call, cache.keys[:1], cache.values[:1])
    with pytest.raises(ValueError, match="x must be \\(tokens, 64\\) float32"):
        module.decoder_stack(stack, mx.zeros((3, 32)), *call[1:], cache.keys, cache.values)
    with pytest.raises(ValueError, match="layer 1's pools must be alike"):
        module.decoder_stack(stack, *call, cache.keys, [cache.values[0], mx.zeros((8, 4, 2, 8))])
    with pytest.raises(ValueError, match="num_rows exceeds"):
        module.decoder_stack(stack, *call[:-1], 4, cache.keys, cache.values)
