"""mlxserve: an MLX-native LLM inference engine (paged KV cache, continuous batching)."""

# Before anything imports mlx: let MLX's CPU backend bind an optimized BLAS if present.
from mlxserve import blas as _blas

_blas.preload()

from mlxserve.config import EngineConfig  # noqa: E402
from mlxserve.core.request import CompletionOutput, RequestOutput  # noqa: E402
from mlxserve.llm import LLM  # noqa: E402
from mlxserve.pooling_params import PoolingParams  # noqa: E402
from mlxserve.sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
