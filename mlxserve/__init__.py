"""mlxserve: an MLX-native LLM inference engine (paged KV cache, continuous batching)."""

from mlxserve.config import EngineConfig
from mlxserve.llm import LLM
from mlxserve.request import CompletionOutput, RequestOutput
from mlxserve.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
