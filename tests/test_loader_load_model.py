"""load_model end to end: dtype (vLLM's --dtype), and hub repo ids from an offline cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from mlx.utils import tree_flatten

from mlxserve.cpu import kernels as cpu
from mlxserve.loader import load_model
from tests.gguf_helpers import write_gguf
from tests.model_helpers import BlockPoolRunner, make_mlx_lm_checkpoint, tiny_config
from tests.paths import ROOT
from tests.test_loader_resolve import make_fake_hub

CONFIG = tiny_config(max_position_embeddings=256)
TOKENS = list(range(3, 20))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(safetensors model directory, a GGUF of the same weights with quantized layers)."""
    tmp = tmp_path_factory.mktemp("tiny")
    oracle, model_dir = make_mlx_lm_checkpoint(tmp / "dir", CONFIG, seed=2)
    write_tiny_tokenizer(model_dir)
    weights = {k: np.array(v) for k, v in tree_flatten(oracle.parameters())}
    qtypes = {k: QT.Q8_0 if "mlp" in k else QT.Q4_0 for k in weights if k.endswith("proj.weight")}
    write_gguf(tmp / "tiny.gguf", CONFIG, weights, qtypes | {"lm_head.weight": QT.Q5_1})
    return model_dir, tmp / "tiny.gguf"


CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}<assistant>"


def write_tiny_tokenizer(model_dir: Path) -> None:
    """A word-level tokenizer.json (built with the tokenizers library) + tokenizer_config."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>", "<unk>", "hello", "world", "the", "capital", "of", "France", "?"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(model_dir / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


def run(model: nn.Module, dtype: mx.Dtype = mx.float32) -> tuple[np.ndarray, mx.Dtype]:
    """Logits of TOKENS (as float32 numpy) and the dtype the model produced them in."""
    runner = BlockPoolRunner(model, num_blocks=8, block_size=4, dtype=dtype)
    logits = runner.step([("r", TOKENS)], all_logits=True)["r"]
    return logits, runner.logits_dtype


def float_dtypes(model: nn.Module) -> set[mx.Dtype]:
    return {
        v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)
    }


@pytest.mark.parametrize(
    ("dtype", "want"),
    [
        ("auto", mx.float32),  # CPU: float32, whatever the checkpoint's torch_dtype
        ("float32", mx.float32),
        ("float", mx.float32),
        ("float16", mx.float16),
        ("half", mx.float16),
        ("bfloat16", mx.bfloat16),
    ],
)
def test_dtype_sets_weights_and_activations(tiny, dtype: str, want: mx.Dtype) -> None:
    model_dir, _ = tiny
    loaded = load_model(str(model_dir), dtype=dtype, skip_tokenizer_init=True)
    assert loaded.dtype == want
    assert float_dtypes(loaded.model) == {want}
    logits, produced = run(loaded.model, want)
    assert produced == want
    reference, _ = run(load_model(str(model_dir), skip_tokenizer_init=True).model)
    tol = {mx.float32: 1e-5, mx.float16: 2e-2, mx.bfloat16: 1e-1}[want]
    np.testing.assert_allclose(logits, reference, atol=tol, rtol=0)


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_quantization_scales_on_cpu(tiny, dtype: str, kernels: bool, monkeypatch) -> None:
    """On the CPU, 16-bit scales make MLX's quantized matmul ~10x slower: on that path they
    become float32, so quantized layers compute (and hand on) float32 whatever ``dtype``
    says. mlxserve's CPU kernels read the stored (float16) scales at full speed, compute in
    float32 and hand on ``dtype``."""
    if kernels and not cpu.available():
        pytest.skip(cpu.status())
    if not kernels:
        monkeypatch.setattr(cpu, "available", lambda: False)
    _, gguf_path = tiny
    loaded = load_model(str(gguf_path), dtype=dtype, skip_tokenizer_init=True)
    want = getattr(mx, dtype)
    layers = loaded.model.model.layers
    assert layers[0].input_layernorm.weight.dtype == want
    assert loaded.model.model.embed_tokens.weight.dtype == want  # F32 in the file: not quantized
    scales = mx.float16 if kernels else mx.float32  # Q4_0, Q8_0, Q5_1 store float16 ones
    for proj in (layers[0].self_attn.q_proj, layers[1].mlp.down_proj, loaded.model.lm_head):
        assert isinstance(proj, nn.QuantizedLinear)
        assert isinstance(proj, cpu.CpuQuantizedLinear) == kernels
        assert (proj.scales.dtype, proj.biases.dtype) == (scales, scales)
    # Q5_1; the CPU kernels hold 5-bit layers at 8 bits (the same values: their fast width)
    assert loaded.model.lm_head.bits == (8 if kernels else 5)
    assert (layers[0].self_attn.q_proj.bits, layers[0].mlp.up_proj.bits) == (4, 8)
    _, produced = run(loaded.model, want)
    assert produced == (want if kernels else mx.float32)  # MLX promotes through float32


HUB_SCRIPT = """
import sys
import numpy as np
from mlx.utils import tree_flatten
from mlxserve.loader import load_model
from tests.model_helpers import BlockPoolRunner
for i, arg in enumerate(sys.argv[2:]):
    model, _, tokenizer = arg.partition("|")  # "model|tokenizer": another model's tokenizer
    loaded = load_model(model, tokenizer=tokenizer or None)
    params = {k: np.array(v) for k, v in tree_flatten(loaded.model.parameters())}
    np.savez(f"{sys.argv[1]}/{i}_params.npz", **params)
    runner = BlockPoolRunner(loaded.model, num_blocks=8, block_size=4)
    logits = runner.step([("r", list(range(3, 20)))], all_logits=True)["r"]
    np.save(f"{sys.argv[1]}/{i}.npy", logits)
    print(loaded.source.kind, loaded.source.name, loaded.source.path)
    print(loaded.tokenizer.encode("hello world ?", add_special_tokens=False))
    print(repr(loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])))
"""

# Logits computed in another process may differ in the last bits: OpenBLAS splits a matmul
# by its thread count, which changes the summation order (OPENBLAS_NUM_THREADS=1 vs 2 moved
# these logits, of size ~2, by up to 3.6e-7, 1.5 float32 ulp). The parameters themselves are
# compared exactly; the logits within 30x that, far below what one changed weight makes.
LOGITS_ATOL = 1e-5


def assert_same_params(saved: Path, model: nn.Module) -> None:
    """The parameters a subprocess saved are exactly ``model``'s (names, dtypes, values)."""
    with np.load(saved) as got:
        want = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
        assert sorted(got.files) == sorted(want)
        for name, value in want.items():
            assert got[name].dtype == value.dtype, name
            np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_repo_ids_load_offline_from_the_hub_cache(tiny, tmp_path: Path) -> None:
    """A repo id and a repo's .gguf file, from a huggingface_hub cache with HF_HUB_OFFLINE=1.

    The same parameters (exactly) and logits as the same files loaded by path; the
    tokenizer is the tokenizers library's.
    """
    model_dir, gguf_path = tiny
    cache = tmp_path / "hub"
    snapshot = make_fake_hub(cache, "acme/tiny-llama", {})
    for f in model_dir.iterdir():
        shutil.copy(f, snapshot / f.name)
    gguf_snapshot = make_fake_hub(cache, "acme/tiny-llama-GGUF", {})
    shutil.copy(gguf_path, gguf_snapshot / "tiny.Q4_0.gguf")

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache))
    # The GGUF has no tokenizer of its own: it borrows the repo's (load_model's tokenizer=).
    models = ["acme/tiny-llama", "acme/tiny-llama-GGUF/tiny.Q4_0.gguf|acme/tiny-llama"]
    out = subprocess.run(
        [sys.executable, "-c", HUB_SCRIPT, str(tmp_path), *models],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,  # generous: this loads four models on a possibly busy machine
    )
    assert out.returncode == 0, out.stderr
    from tokenizers import Tokenizer

    oracle = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected_lines = [str(oracle.encode("hello world ?").ids), repr("<user>hi</s><assistant>")]
    lines = out.stdout.splitlines()
    assert lines[0] == f"dir acme/tiny-llama {snapshot}"
    assert lines[3].startswith("gguf acme/tiny-llama-GGUF/tiny.Q4_0.gguf ")
    assert lines[1:3] == lines[4:6] == expected_lines
    for i, path in enumerate([model_dir, gguf_path]):
        by_path = load_model(str(path), skip_tokenizer_init=True).model
        assert_same_params(tmp_path / f"{i}_params.npz", by_path)
        logits, _ = run(by_path)
        np.testing.assert_allclose(np.load(tmp_path / f"{i}.npy"), logits, rtol=0, atol=LOGITS_ATOL)
