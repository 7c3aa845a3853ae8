"""Shape-alike benchmark models: random weights with the exact shapes of the models people run.

A decode step's cost depends on the tensors' shapes and storage types, not on their values,
so a model with seeded random weights, the real architecture's config and a synthetic
byte-level BPE vocabulary of the real size measures what the real file would::

    python -m bench.shape_models --arch qwen2.5-0.5b --quant Q4_K_M [--quant Q8_0 ...]
    python -m bench.shape_models --list

The F16 GGUF is written with the `gguf` package (llama.cpp's tensor names and metadata, a
chat template, tied embeddings where the real model ties them); each quantized file is
made from it by llama.cpp's own ``llama-quantize`` (mlxserve/cli/bench/llamacpp.py builds it), so
its tensor-type mix is the one real files have: e.g. Q4_K_M of Qwen2.5-0.5B (hidden 896,
not a multiple of 256) has Q5_0/Q8_0 rows where 256-value K-quant blocks do not fit.
Files live in
``mlxserve.cli.bench.common.cache_dir() / "shape-models"``, never in the repository.
"""

from __future__ import annotations

import argparse
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from mlxserve.cli.bench.common import cache_dir

QUANTS = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """One architecture's config as its HF config.json gives it, and its tokenizer's facts."""

    arch: str  # general.architecture (llama.cpp's name)
    hidden: int
    num_layers: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int  # rows of the embedding (the tokenizer's list is padded to it)
    rope_theta: float
    rms_eps: float
    context: int
    pre: str  # tokenizer.ggml.pre
    template: str
    specials: dict[str, int]  # control tokens and their ids
    bos: str
    eos: str
    tied: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    # Llama 3's rope scaling: (factor, low_freq_factor, high_freq_factor, original context)
    llama3_rope: tuple[float, float, float, int] | None = None
    notes: str = field(default="", compare=False)


_QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
_LLAMA3_SPECIALS = {
    "<|begin_of_text|>": 128000,
    "<|end_of_text|>": 128001,
    "<|start_header_id|>": 128006,
    "<|end_header_id|>": 128007,
    "<|eot_id|>": 128009,
}
_QWEN2 = dict(arch="qwen2", rope_theta=1e6, rms_eps=1e-6, context=32768, pre="qwen2")
_QWEN3 = dict(arch="qwen3", rope_theta=1e6, rms_eps=1e-6, context=40960, pre="qwen2")
_CHATML_QWEN = dict(template=CHATML, specials=_QWEN_SPECIALS, bos="<|endoftext|>", eos="<|im_end|>")

SHAPES: dict[str, Shape] = {
    "qwen2.5-0.5b": Shape(
        hidden=896, num_layers=24, intermediate=4864, num_heads=14, num_kv_heads=2,
        head_dim=64, vocab=151936, qkv_bias=True, **_QWEN2, **_CHATML_QWEN,
    ),
    "qwen2.5-1.5b": Shape(
        hidden=1536, num_layers=28, intermediate=8960, num_heads=12, num_kv_heads=2,
        head_dim=128, vocab=151936, qkv_bias=True, **_QWEN2, **_CHATML_QWEN,
    ),
    "qwen3-0.6b": Shape(
        hidden=1024, num_layers=28, intermediate=3072, num_heads=16, num_kv_heads=8,
        head_dim=128, vocab=151936, qk_norm=True, **_QWEN3, **_CHATML_QWEN,
    ),
    "qwen3-1.7b": Shape(
        hidden=2048, num_layers=28, intermediate=6144, num_heads=16, num_kv_heads=8,
        head_dim=128, vocab=151936, qk_norm=True, **_QWEN3, **_CHATML_QWEN,
    ),
    "llama-3.2-1b": Shape(
        arch="llama", hidden=2048, num_layers=16, intermediate=8192, num_heads=32,
        num_kv_heads=8, head_dim=64, vocab=128256, rope_theta=500000.0, rms_eps=1e-5,
        context=131072, pre="llama-bpe", template=LLAMA3, specials=_LLAMA3_SPECIALS,
        bos="<|begin_of_text|>", eos="<|eot_id|>", llama3_rope=(32.0, 1.0, 4.0, 8192),
    ),
    "smollm2-360m": Shape(
        arch="llama", hidden=960, num_layers=32, intermediate=2560, num_heads=15,
        num_kv_heads=5, head_dim=64, vocab=49152, rope_theta=100000.0, rms_eps=1e-5,
        context=8192, pre="smollm", template=CHATML,
        specials={"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2},
        bos="<|im_start|>", eos="<|im_end|>",
    ),
    # Gemma 3's shape, for the table; its writer (SentencePiece vocab, sliding-window
    # metadata, GELU) is not here yet: make_f16 refuses it by name.
    "gemma-3-1b": Shape(
        arch="gemma3", hidden=1152, num_layers=26, intermediate=6912, num_heads=4,
        num_kv_heads=1, head_dim=256, vocab=262144, rope_theta=1e6, rms_eps=1e-6,
        context=32768, pre="default", template="", specials={}, bos="<bos>",
        eos="<end_of_turn>", qk_norm=True, notes="sliding window 512 on 5 of 6 layers",
    ),
}  # fmt: skip
WRITABLE = ("llama", "qwen2", "qwen3")


def _byte_unicode() -> list[str]:
    """GPT-2's byte -> printable character map (byte-level BPE's alphabet), by byte."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def make_vocab(shape: Shape, seed: int = 0) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): a byte-level BPE vocabulary of ``shape.vocab`` tokens.

    The 256 byte tokens, then merged tokens (each a merge of two earlier ones, as BPE
    training makes them: frequent letters and spaces first, so text tokenizes into
    multi-byte tokens), the control tokens at their real ids, and padding tokens (real
    Qwen files pad their list to the embedding's rows too).
    """
    rng = np.random.default_rng(seed)
    alphabet = _byte_unicode()
    n_normal = shape.vocab - len(shape.specials)
    free_ids = [i for i in range(shape.vocab) if i not in set(shape.specials.values())]
    # Merges draw their parts from the earlier tokens, weighted to ASCII letters and " ".
    common = [alphabet[b] for b in b" etaoinshrdlucmfwypvbgk\n"]
    merged: list[str] = []
    merges: list[str] = []
    seen = set(alphabet)
    pool = list(common)
    num_merges = min(n_normal - 256, int(shape.vocab * 0.95) - 256)
    while len(merged) < num_merges:
        a, b = pool[rng.integers(len(pool))], pool[rng.integers(len(pool))]
        if len(a) + len(b) > 12 or a + b in seen:
            if rng.random() < 0.01:  # keep the pool growing past saturated short pieces
                pool.append(alphabet[rng.integers(256)])
            continue
        seen.add(a + b)
        merged.append(a + b)
        merges.append(f"{a} {b}")
        pool.append(a + b)
    pad = [f"[PAD{i}]" for i in range(n_normal - 256 - len(merged))]
    normal = [*alphabet, *merged, *pad]
    tokens = [""] * shape.vocab
    types = [gguf.TokenType.NORMAL] * shape.vocab
    for tok, i in zip(normal, free_ids, strict=True):
        tokens[i] = tok
        if tok.startswith("[PAD"):
            types[i] = gguf.TokenType.USER_DEFINED
    for tok, i in shape.specials.items():
        tokens[i], types[i] = tok, gguf.TokenType.CONTROL
    return tokens, [int(t) for t in types], merges


def _llama3_freqs(shape: Shape) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for Llama 3's scaling (its converter's formula)."""
    factor, low, high, old_ctx = shape.llama3_rope  # type: ignore[misc]
    freqs = 1.0 / shape.rope_theta ** (np.arange(0, shape.head_dim, 2) / shape.head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    out = np.where(wavelen < old_ctx / high, 1.0, 0.0)
    out = np.where(wavelen > old_ctx / low, factor, out)
    mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    out = np.where(mid, 1.0 / ((1 - smooth) / factor + smooth), out)
    return out.astype(np.float32)


def write_f16(shape: Shape, path: Path, seed: int = 0) -> None:
    """The F16 GGUF of ``shape`` with seeded random weights (norms and biases F32)."""
    if shape.arch not in WRITABLE:
        raise SystemExit(f"writing {shape.arch} models is not supported (only {WRITABLE})")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(f"shape-alike {shape.arch} {shape.hidden}x{shape.num_layers}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.num_layers)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.num_heads)
    w.add_head_count_kv(shape.num_kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(shape.vocab)
    tokens, types, merges = make_vocab(shape, seed)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(shape.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(shape.specials[shape.bos])
    w.add_eos_token_id(shape.specials[shape.eos])
    w.add_add_bos_token(shape.arch == "llama" and shape.pre == "llama-bpe")
    w.add_chat_template(shape.template)

    def dense(name: str, rows: int, cols: int, std: float = 0.02) -> None:
        w.add_tensor(name, (rng.standard_normal((rows, cols), np.float32) * std).astype(np.float16))

    def vector(name: str, n: int, value: float | None = None) -> None:
        v = np.full(n, value, np.float32) if value is not None else rng.standard_normal(n) * 0.02
        w.add_tensor(name, v.astype(np.float32))

    h, q_rows = shape.hidden, shape.num_heads * shape.head_dim
    kv_rows = shape.num_kv_heads * shape.head_dim
    dense("token_embd.weight", shape.vocab, h)
    if shape.llama3_rope is not None:
        w.add_tensor("rope_freqs.weight", _llama3_freqs(shape))
    for i in range(shape.num_layers):
        b = f"blk.{i}"
        vector(f"{b}.attn_norm.weight", h, 1.0)
        for part, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
            dense(f"{b}.{part}.weight", rows, h)
            if shape.qkv_bias:
                vector(f"{b}.{part}.bias", rows)
        if shape.qk_norm:
            vector(f"{b}.attn_q_norm.weight", shape.head_dim, 1.0)
            vector(f"{b}.attn_k_norm.weight", shape.head_dim, 1.0)
        dense(f"{b}.attn_output.weight", h, q_rows)
        vector(f"{b}.ffn_norm.weight", h, 1.0)
        dense(f"{b}.ffn_gate.weight", shape.intermediate, h)
        dense(f"{b}.ffn_up.weight", shape.intermediate, h)
        dense(f"{b}.ffn_down.weight", h, shape.intermediate)
    vector("output_norm.weight", h, 1.0)
    if not shape.tied:
        dense("output.weight", shape.vocab, h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def models_dir() -> Path:
    return cache_dir() / "shape-models"


def f16_path(name: str, seed: int = 0) -> Path:
    """The cached F16 GGUF of SHAPES[name], written on first use."""
    path = models_dir() / f"{name}-s{seed}-F16.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_f16(SHAPES[name], tmp, seed)
        tmp.rename(path)
    return path


def quantized_path(name: str, quant: str, seed: int = 0, log=print) -> Path:
    """The cached ``quant`` GGUF of SHAPES[name], made by llama-quantize on first use."""
    if quant.upper() == "F16":
        return f16_path(name, seed)
    path = models_dir() / f"{name}-s{seed}-{quant}.gguf"
    if path.exists():
        return path
    from mlxserve.cli.bench import llamacpp

    source = f16_path(name, seed)
    tool = llamacpp.ensure_built(log=log) / "llama-quantize"
    tmp = path.with_suffix(".tmp")
    log(f"[shape-models] {tool.name} {source.name} -> {path.name}")
    subprocess.run([str(tool), str(source), str(tmp), quant], check=True, capture_output=True)
    tmp.rename(path)
    return path


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type the file holds (gguf's reader)."""
    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--quant", action="append", help=f"F16 or one of {', '.join(QUANTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="print the shapes table and exit")
    args = p.parse_args(argv)
    if args.list:
        for name, s in SHAPES.items():
            writable = "" if s.arch in WRITABLE else "  (table only)"
            print(
                f"{name:14} {s.arch:6} hidden {s.hidden:5} layers {s.num_layers:3} "
                f"ffn {s.intermediate:5} heads {s.num_heads}/{s.num_kv_heads}x{s.head_dim} "
                f"vocab {s.vocab}{' tied' if s.tied else ''}{writable}"
            )
        return
    for quant in args.quant or ["F16"]:
        path = quantized_path(args.arch, quant, args.seed)
        print(path, tensor_types(path))


if __name__ == "__main__":
    main()
