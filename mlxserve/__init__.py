"""mlxserve: an MLX-native LLM inference engine (paged KV cache, continuous batching)."""

# Importing binds nothing: the BLAS under MLX is bound when a model is loaded or a command
# starts (mlxserve.settings.start).
from mlxserve.config import EngineConfig
from mlxserve.core.request import CompletionOutput, RequestOutput
from mlxserve.llm import LLM
from mlxserve.pooling_params import PoolingParams
from mlxserve.sampling_params import SamplingParams

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
