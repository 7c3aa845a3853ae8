"""GGUF reading: exact repacking, llama.cpp's Q/K permutation, config mapping, errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from mlxserve.gguf_file import read_gguf_header, read_tensor_bytes
from mlxserve.loader.gguf import hf_tensor_name, load_gguf, make_config, unpermute_rows
from mlxserve.loader.gguf_quants import REPACKABLE, convert_tensor
from tests.gguf_helpers import close_gguf, llamacpp_permute


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_gguf: Path) -> gguf.GGUFReader:
    """The gguf package's reader of the embedded model (slow: ~5 s of metadata parsing)."""
    return gguf.GGUFReader(smollm2_gguf)


def test_header_reader_agrees_with_gguf_package(smollm2_gguf: Path, smollm2_reader) -> None:
    header = read_gguf_header(smollm2_gguf)
    fields = smollm2_reader.fields
    want = {k: f.contents() for k, f in fields.items() if not k.startswith("GGUF.")}
    assert header.metadata == want
    got = [(t.name, t.qtype, t.shape, t.offset, t.nbytes) for t in header.tensors]
    expected = [
        (t.name, t.tensor_type, tuple(int(n) for n in reversed(t.shape)), t.data_offset, t.n_bytes)
        for t in smollm2_reader.tensors
    ]
    assert got == expected


def test_numpy_repack_is_bit_exact_with_mx_load(smollm2_gguf: Path) -> None:
    """Our Q4_1/Q8_0/F32 conversion reproduces MLX's own GGUF reader bit for bit."""
    reference = mx.load(str(smollm2_gguf))
    header = read_gguf_header(smollm2_gguf)
    for t in header.tensors[:40] + header.tensors[-3:]:
        base = t.name.rsplit(".", 1)[0]
        raw = read_tensor_bytes(smollm2_gguf, t)
        for kind, arr in convert_tensor(raw, t.qtype, t.shape, False).items():
            key = t.name if kind == "weight" else f"{base}.{kind}"
            assert arr.dtype == reference[key].dtype, key
            assert mx.array_equal(arr, reference[key]).item(), key


@pytest.mark.parametrize("num_heads,head_dim", [(3, 64), (2, 8), (4, 128)])
def test_unpermute_inverts_llamacpp_permutation(num_heads: int, head_dim: int) -> None:
    w = np.random.default_rng(0).standard_normal((num_heads * head_dim, 5)).astype(np.float32)
    got = unpermute_rows(mx.array(llamacpp_permute(w, num_heads)), num_heads)
    np.testing.assert_array_equal(np.array(got), w)


def test_permuted_rows_with_interleaved_rope_equal_hf_rope() -> None:
    """Why the un-permute is right: llama.cpp's rows + interleaved RoPE == HF rows + HF RoPE."""
    rng = np.random.default_rng(1)
    heads, head_dim, dim, pos = 2, 16, 12, 7
    wq = rng.standard_normal((heads * head_dim, dim)).astype(np.float32)
    x = mx.array(rng.standard_normal((1, dim)).astype(np.float32))

    def project_rope(w: np.ndarray, traditional: bool) -> np.ndarray:
        q = (x @ mx.array(w).T).reshape(1, heads, 1, head_dim)
        return np.array(
            mx.fast.rope(q, head_dim, traditional=traditional, base=10000.0, scale=1.0, offset=pos)
        )

    hf = project_rope(wq, traditional=False)
    permuted = llamacpp_permute(wq, heads)
    interleaved = project_rope(permuted, traditional=True)
    restored = project_rope(np.array(unpermute_rows(mx.array(permuted), heads)), False)
    np.testing.assert_allclose(restored, hf, atol=1e-5)
    # Interleaved RoPE on llama.cpp's rows gives HF's rotated q in the same permuted order,
    # so q.k (q and k permuted alike) is what attention sees with HF's weights.
    np.testing.assert_allclose(
        interleaved.reshape(-1), llamacpp_permute(hf.reshape(-1), heads), atol=1e-5
    )


def test_smollm2_config_and_names(smollm2_gguf: Path) -> None:
    config, weights, meta = load_gguf(smollm2_gguf)
    # Hand-checked against HuggingFaceTB/SmolLM2-135M-Instruct's config.json.
    expected = {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "vocab_size": 49152,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert weights["model.layers.0.self_attn.k_proj.scales"].shape == (192, 18)
    assert "lm_head.weight" not in weights
    assert meta["tokenizer.ggml.eos_token_id"] == 2


def test_tensor_name_mapping() -> None:
    assert hf_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("rope_freqs.weight") is None


def test_unsupported_architecture_names_it() -> None:
    meta = {"general.architecture": "gpt2", "gpt2.block_count": 2}
    with pytest.raises(ValueError, match=r"x\.gguf: unsupported GGUF architecture 'gpt2'"):
        make_config(meta, {}, Path("x.gguf"))


def test_missing_metadata_names_the_keys() -> None:
    meta = {"general.architecture": "llama", "llama.block_count": 2}
    with pytest.raises(ValueError, match="llama.embedding_length"):
        make_config(meta, {}, Path("x.gguf"))


def random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    """Valid blocks of any type: random bytes, with small positive f16 scale fields."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, (rows * cols // block_values, block_bytes), dtype=np.uint8)
    # f16 scale fields: (offset, count); Q2_K, Q3_K and Q6_K keep theirs at the block's end.
    fields = {"Q2_K": (-4, 2), "Q3_K": (-2, 1), "Q6_K": (-2, 1)}
    two = qtype.name.endswith(("_K", "_1"))
    start, count = fields.get(qtype.name, (0, 2 if two else 1))
    scales = rng.uniform(0.001, 0.02, (len(raw), count)).astype(np.float16)
    raw[:, start : start + 2 * count or None] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", sorted(REPACKABLE, key=int), ids=lambda t: t.name)
def test_repacked_blocks_equal_gguf_dequantize(qtype: gguf.GGMLQuantizationType) -> None:
    """Each repackable type's MLX form reproduces gguf's dequantized values exactly."""
    raw = random_blocks(qtype, 6, 512)
    want = gguf.quants.dequantize(raw, qtype).reshape(6, 512)
    parts = convert_tensor(raw, qtype, (6, 512), keep_float=False)
    bits = parts["weight"].shape[1] * 32 // 512
    assert bits == REPACKABLE[qtype]
    scales, biases = (parts[k].astype(mx.float32) for k in ("scales", "biases"))
    got = mx.dequantize(parts["weight"], scales, biases, group_size=32, bits=bits)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", ["Q6_K", "Q3_K", "Q2_K", "IQ4_NL"])
def test_other_types_requantized_within_half_a_step(qtype: str) -> None:
    qt = gguf.GGMLQuantizationType[qtype]
    raw = random_blocks(qt, 4, 256)
    want = gguf.quants.dequantize(raw, qt).reshape(4, 256).reshape(-1, 32)
    parts = convert_tensor(raw, qt, (4, 256), keep_float=False)
    bits = parts["weight"].shape[1] * 32 // 256
    assert bits == (8 if qtype == "Q6_K" else 4)
    got = mx.dequantize(parts["weight"], parts["scales"], parts["biases"], group_size=32, bits=bits)
    half_step = (want.max(1) - want.min(1)) / (2**bits - 1) / 2
    err = np.abs(np.array(got).reshape(-1, 32) - want)
    assert (err <= half_step[:, None] * 1.0001 + 1e-7).all()
    kept = convert_tensor(raw, qt, (4, 256), keep_float=True)["weight"]
    assert kept.dtype == mx.float32
    np.testing.assert_array_equal(np.array(kept).reshape(-1, 32), want)


def test_unknown_tensor_names_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")  # qwen2 has no experts (qwen2moe does)
    for key, value in [("embedding_length", 32), ("block_count", 1), ("feed_forward_length", 64)]:
        writer.add_uint32(f"qwen2.{key}", value)
    writer.add_uint32("qwen2.attention.head_count", 2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 64, 32), np.float32))
    close_gguf(writer)
    with pytest.raises(
        ValueError, match=r"moe\.gguf: tensor\(s\) .* no place for: blk\.0\.ffn_gate_exps\.weight"
    ):
        load_gguf(path)
