"""The mlx-lm adapter's surface: version pin, refusals, per-layer cache specs, pools,
quantized checkpoints, mlx-lm left working, and the engine running an adapted model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.loader.local import read_model_dir
from mlxserve.models import KVCache, build_model, mlx_lm_zoo
from mlxserve.models.mlx_lm_adapter import (
    LayerCacheSpec,
    UnsupportedModelError,
    install,
    paged_sdpa,
    require_mlx_lm,
)
from tests.model_helpers import BlockPoolRunner, make_mlx_lm_checkpoint
from tests.paths import ROOT
from tests.zoo_configs import DROP, WINDOW, ZOO, config


def build_case(tmp_path: Path, cfg: dict[str, Any], seed: int = 0, **kwargs) -> tuple:
    """(mlx-lm oracle, mlxserve's model built by the registry) for a config."""
    oracle, path = make_mlx_lm_checkpoint(tmp_path, cfg, seed=seed, **kwargs)
    return oracle, build_model(*read_model_dir(path))


# ---- version pin -----------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.32.1", "0.33.0", "1.0.0"])
def test_untested_mlx_lm_versions_are_refused(monkeypatch, version: str) -> None:
    import mlx_lm

    monkeypatch.setattr(mlx_lm, "__version__", version)
    with pytest.raises(UnsupportedModelError, match=rf"mlx-lm {version} is not a version .*"):
        require_mlx_lm()


def test_tested_mlx_lm_version_and_missing_mlx_lm(monkeypatch) -> None:
    assert require_mlx_lm().__name__ == "mlx_lm"  # the installed one is in the tested range
    monkeypatch.setitem(sys.modules, "mlx_lm", None)  # import fails as if not installed
    with pytest.raises(UnsupportedModelError, match=r"not installed: pip install 'mlx-lm>="):
        require_mlx_lm()


# ---- refusals --------------------------------------------------------------------------------
REFUSED = {
    "gemma2": (
        config("gemma2", num_key_value_heads=1, query_pre_attn_scalar=16, sliding_window=WINDOW),
        "gemma2: cache layer 0 computes attention outside scaled_dot_product_attention",
    ),
    "deepseek_v3": (
        config(
            "deepseek_v3",
            num_key_value_heads=4,
            head_dim=DROP,
            kv_lora_rank=32,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            v_head_dim=16,
            qk_nope_head_dim=16,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "deepseek_v3: cache layer 0: the attention call got keys/values other than",
    ),
    "falcon_h1": (
        {
            "model_type": "falcon_h1",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 128,
            "vocab_size": 320,
            "mamba_d_ssm": 64,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_d_state": 8,
            "mamba_n_groups": 1,
            "mamba_d_conv": 4,
            "max_position_embeddings": 512,
        },
        r"falcon_h1: cache layer 0 \(CacheList\): layers with several caches",
    ),
    "plamo3": (
        config("plamo3", num_hidden_layers=4, window_size=WINDOW, sliding_window_pattern=2),
        "plamo3: cache layer 0: the model masks a window of 9 tokens but its cache keeps 8",
    ),
    "gpt_bigcode": (
        {
            "model_type": "gpt_bigcode",
            "n_embd": 64,
            "n_layer": 2,
            "n_inner": 128,
            "n_head": 4,
            "n_positions": 512,
            "layer_norm_epsilon": 1e-5,
            "vocab_size": 320,
        },
        "gpt_bigcode: its layers do not run on one token per row with per-token positions",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_the_adapter_cannot_run_is_refused_at_load(name: str, tmp_path: Path) -> None:
    """Attention by hand, MLA latent scores, several caches in one layer, a mask window other
    than the cache's, scalar positions: each is refused with its reason when the model is built,
    never run wrongly."""
    cfg, message = REFUSED[name]
    _, path = make_mlx_lm_checkpoint(tmp_path, cfg)
    weights = mx.load(str(path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=message):
        mlx_lm_zoo.build(cfg, weights)


def test_registry_says_why_an_mlx_lm_architecture_is_not_run() -> None:
    with pytest.raises(ValueError, match=r"'gemma2' \(computes attention by hand"):
        build_model({"model_type": "gemma2"}, {})
    with pytest.raises(ValueError, match=r"'rwkv7' \(mlx-lm implements it, but mlxserve's"):
        build_model({"model_type": "rwkv7"}, {})
    assert not set(mlx_lm_zoo.MODEL_TYPES) & set(mlx_lm_zoo.NOT_SUPPORTED)
    assert {c["model_type"] for c in ZOO.values()} == set(mlx_lm_zoo.MODEL_TYPES)


# ---- cache specs and pools -------------------------------------------------------------------
def test_cache_specs_follow_make_cache(tmp_path: Path) -> None:
    _, gpt_oss = build_case(tmp_path / "a", ZOO["gpt_oss"])
    full = LayerCacheSpec("full_attention", 2, 16, 16)
    window = LayerCacheSpec("sliding_window", 2, 16, 16, WINDOW)
    assert gpt_oss.cache_specs == (window, full, window, full)  # alternating, as gpt-oss
    layout = gpt_oss.kv_cache_layout  # two groups of two layers sharing two tensors
    assert [(g.window, g.layers) for g in layout.groups] == [(WINDOW, (0, 2)), (None, (1, 3))]
    assert layout.layer_tensors == (0, 0, 1, 1) and layout.tensor_shapes == ((2, 16, 16),) * 2
    assert window.bytes_per_token(mx.float16) == 2 * (16 + 16) * 2

    # Gemma 4: 6 layers, the last 2 reuse K/V of earlier ones, so 4 pools; global layers
    # have 32-dim heads.
    _, gemma4 = build_case(tmp_path / "b", ZOO["gemma4_text"])
    assert [(s.kind, s.k_head_dim) for s in gemma4.cache_specs] == [
        ("sliding_window", 16),
        ("sliding_window", 16),
        ("full_attention", 32),
        ("sliding_window", 16),
    ]
    layout = gemma4.kv_cache_layout  # shapes differ: one group, one tensor per layer
    assert [g.layers for g in layout.groups] == [(0, 1, 2, 3)]
    assert layout.tensor_shapes == ((2, 16, 16), (2, 16, 16), (2, 32, 32), (2, 16, 16))
    assert "sliding-window blocks are kept" in layout.reason
    _, deepseek = build_case(tmp_path / "c", ZOO["deepseek_v2"])
    assert deepseek.kv_layer_shapes == [(4, 24, 16)] * 2  # K = nope + rope dims, V its own


def test_kv_cache_pools_per_layer_shapes() -> None:
    shapes = [(2, 16, 16), (1, 32, 32), (4, 24, 16)]
    cache = KVCache.allocate_layers(shapes, num_blocks=3, block_size=4, dtype=mx.float32)
    assert [k.shape for k in cache.keys] == [(3, 4, 2, 16), (3, 4, 1, 32), (3, 4, 4, 24)]
    assert [v.shape for v in cache.values] == [(3, 4, 2, 16), (3, 4, 1, 32), (3, 4, 4, 16)]
    cache.keys[2] = cache.keys[2] + 1
    cache.ensure_num_blocks(5)
    assert [v.shape[0] for v in cache.keys + cache.values] == [5] * 6
    assert cache.values[2].shape == (5, 4, 4, 16)
    k = np.array(cache.keys[2])
    assert (k[:3] == 1).all() and (k[3:] == 0).all()  # old blocks kept, new ones zeroed


# ---- quantized checkpoints -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "quantize"),
    [
        ("qwen3_moe", {"group_size": 32, "bits": 4}),
        ("gpt_oss", {"group_size": 32, "bits": 4, "mode": "mxfp4"}),
    ],
)
def test_quantized_checkpoint_matches_mlx_lm(name: str, quantize, tmp_path: Path) -> None:
    """Quantized as mlx-lm quantizes (switch layers included), loaded as mlx-lm loads them."""
    oracle, model = build_case(tmp_path, ZOO[name], seed=2, quantize=quantize)
    kinds = {type(m).__name__ for _, m in model.named_modules()}
    assert {"QuantizedLinear", "QuantizedSwitchLinear"} <= kinds
    assert "Linear" not in kinds and "SwitchLinear" not in kinds
    tokens = list(range(3, 40))
    runner = BlockPoolRunner(model, num_blocks=16, block_size=4)
    got = runner.step([("r", tokens[:20])], all_logits=True)["r"]
    got = np.concatenate([got, runner.step([("r", tokens[20:])], all_logits=True)["r"]])
    from mlx_lm.models.cache import make_prompt_cache

    want = np.array(oracle(mx.array(tokens)[None], cache=make_prompt_cache(oracle))[0])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_quantized_weights_without_a_quantization_config_are_refused(tmp_path: Path) -> None:
    _, path = make_mlx_lm_checkpoint(
        tmp_path, ZOO["qwen3_moe"], quantize={"group_size": 32, "bits": 4}
    )
    cfg, weights = read_model_dir(path)
    cfg.pop("quantization")
    cfg.pop("quantization_config", None)
    with pytest.raises(ValueError, match=r"quantized \(.scales tensors\) but the config has no"):
        build_model(cfg, weights)


# ---- mlx-lm keeps working --------------------------------------------------------------------
def test_mlx_lm_attention_is_untouched_outside_paged_steps() -> None:
    """mlx-lm model modules now call paged_sdpa; with mlx-lm's own caches (or none) it is
    exactly mlx-lm's function, sinks and masks included."""
    from mlx_lm.models import base, gpt_oss
    from mlx_lm.models.cache import KVCache as MlxKVCache

    install(gpt_oss)  # as a build does
    assert gpt_oss.scaled_dot_product_attention is paged_sdpa
    assert base.scaled_dot_product_attention is not paged_sdpa
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal((1, s, 5, 16)).astype(np.float32)) for s in (4, 2, 2))
    sinks = mx.array(rng.standard_normal(4).astype(np.float32))
    for cache, mask in ((MlxKVCache(), "causal"), (None, None)):
        got = paged_sdpa(q, k, v, cache, 0.25, mask, sinks=sinks)
        want = base.scaled_dot_product_attention(q, k, v, cache, 0.25, mask, sinks=sinks)
        np.testing.assert_array_equal(np.array(got), np.array(want))


# ---- the Metal path --------------------------------------------------------------------------
def test_adapted_model_through_the_metal_kernels(tmp_path: Path) -> None:
    """gpt-oss (sliding windows, sinks) with the Metal kernels (the emulator on Linux) gives
    the fallback's logits: prefills longer than the window, then decodes."""
    from mlxserve import ops

    emulator = None
    if mx.metal.is_available():
        factory = None
    elif sys.platform == "linux":
        from metal.checker.emulator import Emulator

        emulator = Emulator()
        factory = emulator.metal_kernel
    else:
        pytest.skip("needs the Linux emulator or Metal")
    _, model = build_case(tmp_path, ZOO["gpt_oss"], seed=3)
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, model.vocab_size, n).tolist() for n in (13, 6))

    def run(backend) -> list[np.ndarray]:
        runner = BlockPoolRunner(model, num_blocks=16, block_size=4)
        with backend:
            first = runner.step([("a", a), ("b", b)], all_logits=True)
            second = runner.step([("a", [7]), ("b", [9])])
        return [first["a"], first["b"], second["a"], second["b"]]

    got = run(ops.force_backend("metal", factory))
    want = run(ops.force_backend("fallback"))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
    if emulator is not None:  # 4 layers x (write, attend) x 2 steps, all on the kernels
        names = [launch["name"] for launch in emulator.launches]
        assert names.count("paged_prefill_tiled") == names.count("paged_decode") == 4


# ---- the engine ------------------------------------------------------------------------------
def test_engine_runs_an_adapted_model(tmp_path: Path) -> None:
    """A gpt-oss checkpoint (sliding window, sinks, MoE) through LLM: the registry falls back
    to the adapter, and greedy tokens equal mlx-lm's own generation."""
    from mlx_lm.generate import generate_step

    from mlxserve import LLM, SamplingParams
    from tests.engine_helpers import VOCAB_SIZE, write_tokenizer

    cfg = ZOO["gpt_oss"] | {"vocab_size": VOCAB_SIZE}
    oracle, path = make_mlx_lm_checkpoint(tmp_path, cfg, seed=5)
    write_tokenizer(path)
    llm = LLM(str(path), num_blocks=64, block_size=4, max_num_batched_tokens=16)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB_SIZE, n).tolist() for n in (5, 19, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    for prompt, out in zip(prompts, outs, strict=True):
        want = [
            int(t)
            for t, _ in generate_step(mx.array(prompt), oracle, max_tokens=12, sampler=argmax)
        ]
        assert out.outputs[0].token_ids == want


def test_readme_lists_the_architectures_the_code_supports() -> None:
    readme = (ROOT / "docs" / "models.md").read_text()
    start, end = "<!-- models-table:start -->\n", "\n<!-- models-table:end -->"
    table = readme[readme.index(start) + len(start) : readme.index(end)]
    assert table == mlx_lm_zoo.models_table(), (
        "docs/models.md's model table is stale; regenerate it with: python -c 'from "
        "mlxserve.models.mlx_lm_zoo import models_table; print(models_table())'"
    )
