"""OpenAI-compatible HTTP server: `mlxserve serve` (FastAPI + uvicorn over AsyncLLM)."""

from mlxserve.server.app import ServerConfig, build_app
from mlxserve.server.metrics import ServerMetrics

__all__ = ["ServerConfig", "ServerMetrics", "build_app"]
