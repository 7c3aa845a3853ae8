"""A complete tiny model directory (weights, tokenizer, chat template) for engine tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.model_helpers import make_mlx_lm_checkpoint
from tests.model_helpers import tiny_config as model_tiny_config

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Once upon a time there was a little engine that could.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9, and more numbers.",
] * 20
VOCAB_SIZE = 384


def tiny_config(model_type: str = "llama", **overrides: Any) -> dict[str, Any]:
    """The tiny test model, with the tokenizer's vocabulary and room for long prompts."""
    return model_tiny_config(model_type, vocab_size=VOCAB_SIZE, max_position_embeddings=4096) | (
        overrides
    )


def write_tokenizer(path: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """A byte-level BPE trained on a small corpus, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "chat_template": CHATML,
            }
        )
    )


def make_tiny_model_dir(path: Path, seed: int = 0, **overrides: Any):
    """(mlx-lm oracle model, directory mlxserve can load by path)."""
    oracle, model_dir = make_mlx_lm_checkpoint(path, tiny_config(**overrides), seed=seed)
    write_tokenizer(model_dir)
    return oracle, model_dir


def perturb_weights(model_dir: Path, out_dir: Path, scale: float, seed: int = 0) -> Path:
    """A copy of a tiny model directory whose float weights each get Gaussian noise of
    ``scale`` times their own standard deviation: a draft model with the target's
    tokenizer whose predictions agree with the target's often, not always."""
    import shutil

    import mlx.core as mx

    weights = mx.load(str(model_dir / "model.safetensors"))
    keys = mx.random.split(mx.random.key(seed), len(weights))
    noisy = {}
    for (name, w), key in zip(sorted(weights.items()), keys, strict=True):
        noise = mx.random.normal(w.shape, key=key) * (scale * mx.std(w.astype(mx.float32)))
        noisy[name] = (w + noise).astype(w.dtype)
    out_dir.mkdir(parents=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), noisy, metadata={"format": "mlx"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out_dir / name)
    return out_dir
