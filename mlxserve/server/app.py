"""The FastAPI app: the registered APIs, the API-key check, CORS, metrics, the stats log.

Each API (server/api.py's API record) brings its routes, request bodies, paths and error
shape; ``APIS`` lists them. The app itself adds:

GET  /health /version /metrics /cache/stats
GET  / (the chat page), /docs, /redoc (mlxserve.server.webui)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.middleware.cors import CORSMiddleware

from mlxserve import __version__
from mlxserve.engine.async_llm import AsyncLLM
from mlxserve.server import openapi as doc
from mlxserve.server import prompt_normalization
from mlxserve.server.anthropic import ANTHROPIC_API
from mlxserve.server.api import API
from mlxserve.server.auth import APIKeyMiddleware
from mlxserve.server.body import DEFAULT_MAX_REQUEST_BODY_BYTES
from mlxserve.server.errors import (
    add_error_shape,
    closing_headers,
    error_body,
    install_error_handlers,
)
from mlxserve.server.metrics import ServerMetrics
from mlxserve.server.ollama import OLLAMA_API
from mlxserve.server.openai_api import OPENAI_API
from mlxserve.server.responses import RESPONSES_API
from mlxserve.server.served_model import make_served_model
from mlxserve.server.serving import ModelLeases, Serving
from mlxserve.server.webui import add_webui_routes

logger = logging.getLogger("mlxserve")

# The APIs the server speaks, in the order their routes are registered. Adding an API is
# its module (exporting an API record) plus one line here.
APIS: list[API] = [OPENAI_API, ANTHROPIC_API, RESPONSES_API, OLLAMA_API]


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings of `mlxserve serve`."""

    model_names: tuple[str, ...]
    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()  # empty: no CORS headers at all
    log_stats_interval: float | None = 10.0  # seconds; None: no periodic stats line
    model_root: str | None = None  # the model's name or repo id (never a local path): /v1/models
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # Chat replies: the tool-call format and the reasoning parser (None: from the template).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # Agents' volatile prompt parts to neutralize (server/prompt_normalization.PARTS).
    prompt_normalization: tuple[str, ...] = prompt_normalization.DEFAULT
    # The model's sampling defaults for fields a request leaves out ({}: OpenAI's defaults).
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model_names:
            raise ValueError("model_names must name at least one model")
        if any(not k for k in self.api_keys):
            raise ValueError("api_key must not be empty")
        if self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}"
            )


def build_app(
    llm: AsyncLLM | None,
    metrics: ServerMetrics,
    config: ServerConfig,
    serving: Serving | None = None,
) -> FastAPI:
    """The app over a running AsyncLLM (whose on_step feeds ``metrics``), or over the
    models of ``serving`` (several models: server/serving.py): every API in APIS, health,
    version, metrics and the web page."""
    if serving is None:
        assert llm is not None, "build_app needs a running AsyncLLM or a Serving"
        model = make_served_model(
            llm,
            config.model_names,
            config.tool_call_parser,
            config.reasoning_parser,
            config.sampling_defaults,
            root=config.model_root,
            prompt_normalization=config.prompt_normalization,
        )
        serving = Serving([model])

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = None
        if config.log_stats_interval:
            task = asyncio.create_task(_log_stats(metrics, config.log_stats_interval))
        serving.start()
        yield
        await serving.stop()
        if task is not None:
            task.cancel()

    # /docs and /redoc come from add_webui_routes, with local assets instead of a CDN's.
    app = FastAPI(
        title="mlxserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.in_flight = serving.in_flight  # for a graceful shutdown (server/shutdown.py)
    app.state.serving = serving
    install_error_handlers(app)
    doc.install_openapi(app, [b for api in APIS for b in api.bodies], serving.model_names)
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=config.api_keys, apis=APIS)
    app.add_middleware(ModelLeases, serving=serving)  # no unload under a request
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )

    @app.get("/health", responses=_HEALTH_RESPONSES)
    async def health() -> Response:
        if not serving.is_running:
            message = "the engine thread has stopped"
        elif serving.in_flight.is_draining:  # load balancers: stop sending requests here
            message = "the server is shutting down"
        else:
            return Response(status_code=200)
        body = error_body(message, "service_unavailable")
        return JSONResponse(body, 503, headers=closing_headers(503))

    @app.get("/version", response_model=None, responses={200: doc.ok(doc.Version)})
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics", response_class=Response, responses=_METRICS_RESPONSES)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/cache/stats", response_model=None, responses={200: doc.ok(doc.CacheStats)})
    async def cache_stats() -> dict:
        """Each loaded model's prefix cache: blocks and bytes per tier, hits since start."""
        data = [{"model": m.name} | m.llm.cache_stats().as_dict() for m in serving.models]
        return {"data": data}

    for api in APIS:
        for prefix in api.prefixes:  # framework errors (404, 405...) in the API's shape too
            add_error_shape(app, prefix, api.error_response)
        api.add_routes(app, serving, config.max_request_body_bytes)
    add_webui_routes(app)
    return app


_HEALTH_RESPONSES = {
    200: {"description": "The engine runs", "content": None},
    503: {
        "description": "The engine has stopped, or the server is shutting down",
        "model": doc.ErrorResponse,
    },
}
_METRICS_RESPONSES = {
    200: {
        "description": "Prometheus text format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


async def _log_stats(metrics: ServerMetrics, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        line = metrics.log_line()
        if line is not None:
            logger.info(line)
