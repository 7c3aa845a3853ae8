"""GGUF files of the mlx-lm families (issue 12) against mlx-lm's own model.

Each case: a tiny random mlx-lm model (the oracle); its weights in the HF checkpoint layout
written to GGUF as llama.cpp's converter writes them (tests/gguf_llamacpp.py: the gguf
package's name map, expert merging, Q/K permutation, Gemma's norm shift, gpt-oss's MXFP4
repacking, the converter's metadata keys); the file loaded by ``load_model`` and run on the
block pool through the mlx-lm adapter. Equal logits over 40 positions (every sliding window
here is 8) prove the architecture's name map, config and tensor fixes; greedy tokens through
the engine are checked for a few.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from mlxserve.loader import load_model
from tests.gguf_llamacpp import hf_checkpoint, write_llamacpp_gguf
from tests.model_helpers import BlockPoolRunner, make_mlx_lm_checkpoint, mlx_lm_chunk_logits
from tests.zoo_configs import WINDOW, ZOO, config

TOKENS = list(range(3, 43))  # 40 positions: past every window, every RoPE band matters

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}

# Configs as the families' HF configs have them; where llama.cpp hard-codes a value it
# does not write (gemma3's 1-in-6 global layers, cohere2's 1-in-4, smollm3's NoPE every
# 4th layer), the config uses llama.cpp's value, as the real models do.
CASES: dict[str, dict[str, Any]] = {
    "qwen3moe": ZOO["qwen3_moe"],
    "qwen2moe": ZOO["qwen2_moe"],
    # OLMoE is multi-head (llama.cpp's OLMoE has no GQA: its k_norm spans all heads)
    "olmoe": ZOO["olmoe"] | {"num_key_value_heads": ZOO["olmoe"]["num_attention_heads"]},
    "mixtral": ZOO["mixtral"],
    "gemma3": config(
        "gemma3_text",
        num_hidden_layers=6,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        sliding_window_pattern=6,
        rope_local_base_freq=10000.0,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    "olmo2": ZOO["olmo2"],
    "granite": ZOO["granite"],
    "cohere2": ZOO["cohere2"] | {"sliding_window_pattern": 4, "tie_word_embeddings": True},
    "smollm3": ZOO["smollm3"] | {"no_rope_layer_interval": 4},
    "phi3": ZOO["phi3"] | {"original_max_position_embeddings": 512},
    "phi3-longrope": ZOO["phi3-longrope"],
    "gpt-oss": ZOO["gpt_oss"] | {"rope_scaling": YARN},
}
# Quantized variants: (case, {GGUF tensor suffix: type}, oracle quantization).
MXFP4_EXPERTS = {
    "group_size": 32,
    "bits": 4,
    "mode": "mxfp4",
    "quant_predicate": lambda path, module: ".experts." in f"{path}.",
}
QUANTIZED = {
    "qwen3moe-q8_0": ("qwen3moe", {"_exps.weight": QT.Q8_0, "attn_q.weight": QT.Q4_0}),
    "mixtral-q8_0": ("mixtral", {"_exps.weight": QT.Q8_0, "attn_k.weight": QT.Q4_1}),
}


def oracle_and_gguf(
    name: str, case: dict[str, Any], tmp_path: Path, qtypes=None, quantize=None, **options: Any
) -> tuple[Any, Path]:
    """The mlx-lm oracle and its GGUF file; with ``qtypes`` the oracle's weights become
    gguf's dequantization of the quantized bytes written (so equal logits mean exact)."""
    model, _ = make_mlx_lm_checkpoint(tmp_path / "ref", case, seed=11, quantize=quantize)
    path = tmp_path / f"{name}.gguf"
    hf = hf_checkpoint(case["model_type"], model)
    written = write_llamacpp_gguf(path, case, hf, qtypes, **options)
    if qtypes:
        stacked = (
            "block_sparse_moe.switch_mlp" if case["model_type"] == "mixtral" else "mlp.switch_mlp"
        )
        experts = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
        weights = {}
        for hf_name, value in written.items():
            mlx_name = re.sub(r"(block_sparse_moe|mlp)\.experts", stacked, hf_name)
            for short, proj in experts.items():
                mlx_name = mlx_name.replace(f".{short}.", f".{proj}.")
            weights[mlx_name] = mx.array(value)
        model.load_weights(list(weights.items()), strict=True)
    return model, path


def paged_logits(model) -> np.ndarray:  # (len(TOKENS), vocab)
    return BlockPoolRunner(model, num_blocks=32, block_size=4).step([("r", TOKENS)], True)["r"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_gguf_family_equals_mlx_lm(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    oracle, path = oracle_and_gguf(name, case, tmp_path)
    got = load_model(str(path), skip_tokenizer_init=True)
    assert got.config["model_type"] == case["model_type"]
    want = mlx_lm_chunk_logits(oracle, [TOKENS])[0]
    np.testing.assert_allclose(paged_logits(got.model), want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantized_experts_are_repacked_exactly(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q8_0 / Q4_0 blocks of stacked experts load as quantized switch layers, bit for bit:
    the oracle runs on gguf's dequantization of the very bytes written (on float
    activations: int8 ones, the CPU default, round x on purpose)."""
    monkeypatch.setenv("MLXSERVE_CPU_INT8", "off")  # read when the model loads
    case_name, qtypes = QUANTIZED[name]
    oracle, path = oracle_and_gguf(name, CASES[case_name], tmp_path, qtypes)
    got = load_model(str(path), skip_tokenizer_init=True, cpu_dequantize=False)
    layer = got.model.model.model.layers[0]
    moe = layer.block_sparse_moe if case_name == "mixtral" else layer.mlp
    assert moe.switch_mlp.gate_proj.bits == 8 and moe.switch_mlp.gate_proj.weight.ndim == 3
    want = mlx_lm_chunk_logits(oracle, [TOKENS])[0]
    np.testing.assert_allclose(paged_logits(got.model), want, atol=2e-4, rtol=2e-4)


def test_gpt_oss_mxfp4_experts_equal_mlx_lm(tmp_path: Path) -> None:
    """gpt-oss with MXFP4 experts (as released): HF blocks -> GGML MXFP4 (converter) ->
    MLX mxfp4 (loader) is lossless, so the logits equal mlx-lm's on the HF checkpoint."""
    case = CASES["gpt-oss"]
    oracle, path = oracle_and_gguf("gpt-oss-mxfp4", case, tmp_path, quantize=MXFP4_EXPERTS)
    got = load_model(str(path), skip_tokenizer_init=True)
    quant = got.config["quantization"]
    assert quant["mode"] == "mxfp4" and quant["bits"] == 4 and quant["group_size"] == 32
    experts = got.model.model.model.layers[0].mlp.experts.gate_proj
    assert experts.mode == "mxfp4" and experts.weight.dtype == mx.uint32
    want = mlx_lm_chunk_logits(oracle, [TOKENS])[0]
    np.testing.assert_allclose(paged_logits(got.model), want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("name", ["gemma3", "gpt-oss"])
def test_engine_greedy_tokens_equal_mlx_lm(name: str, tmp_path: Path) -> None:
    """A GGUF of each through LLM (batched, chunked prefill at 16 tokens, prompts longer than
    the window): greedy tokens equal mlx-lm's own generation on the HF weights."""
    from mlx_lm.generate import generate_step

    from mlxserve import LLM, SamplingParams
    from tests.engine_helpers import VOCAB_SIZE, write_tokenizer

    case = CASES[name] | {"vocab_size": VOCAB_SIZE}
    quantize = MXFP4_EXPERTS if name == "gpt-oss" else None
    oracle, path = oracle_and_gguf(name, case, tmp_path, quantize=quantize)
    write_tokenizer(tmp_path / "ref")  # the GGUF has no vocabulary: borrow a tokenizer
    llm = LLM(
        str(path),
        tokenizer=str(tmp_path / "ref"),
        num_blocks=64,
        block_size=4,
        max_num_batched_tokens=16,
    )
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, VOCAB_SIZE, n).tolist() for n in (5, 23, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    for prompt, out in zip(prompts, outs, strict=True):
        steps = generate_step(mx.array(prompt), oracle, max_tokens=12, sampler=argmax)
        assert out.outputs[0].token_ids == [int(t) for t, _ in steps]


def test_readme_lists_the_gguf_architectures_the_code_supports() -> None:
    from mlxserve.loader.gguf_archs import gguf_table

    readme = (Path(__file__).parent.parent / "docs" / "models.md").read_text()
    start, end = "<!-- gguf-table:start -->\n", "\n<!-- gguf-table:end -->"
    table = readme[readme.index(start) + len(start) : readme.index(end)]
    assert table == gguf_table(), (
        "docs/models.md's GGUF table is stale; regenerate it with: python -c 'from "
        "mlxserve.loader.gguf_archs import gguf_table; print(gguf_table())'"
    )
