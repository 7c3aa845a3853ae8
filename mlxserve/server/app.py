"""The FastAPI app: routes, API-key check, CORS, metrics and the periodic stats log.

GET  /health /version /metrics /v1/models /v1/models/{id}
GET  / (the chat page), /docs, /redoc (mlxserve.server.webui)
POST /v1/completions /v1/chat/completions /v1/embeddings /tokenize /detokenize
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxserve import __version__
from mlxserve.engine.async_llm import AsyncLLM
from mlxserve.server import openapi as doc
from mlxserve.server import prompt_normalization
from mlxserve.server.anthropic import (
    AnthropicServing,
    CountTokensRequest,
    MessagesRequest,
    add_anthropic_routes,
)
from mlxserve.server.anthropic import error_body as anthropic_error_body
from mlxserve.server.body import DEFAULT_MAX_REQUEST_BODY_BYTES, parse_body
from mlxserve.server.chat_tools import ChatFeatures
from mlxserve.server.embeddings import EmbeddingRequest, create_embedding
from mlxserve.server.errors import (
    APIError,
    bad_request,
    closing_headers,
    error_body,
    install_error_handlers,
)
from mlxserve.server.metrics import ServerMetrics
from mlxserve.server.ollama import OllamaServing, add_ollama_routes
from mlxserve.server.ollama_protocol import (
    OllamaChatRequest,
    OllamaDeleteRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaPullRequest,
    OllamaShowRequest,
)
from mlxserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from mlxserve.server.responses import (
    InputTokensRequest,
    ResponsesRequest,
    ResponsesServing,
    add_responses_routes,
)
from mlxserve.server.serving import OpenAIServing
from mlxserve.server.webui import add_webui_routes

logger = logging.getLogger("mlxserve")

# Paths that need the API key when one is set (health, version and metrics stay open
# for load balancers and Prometheus, as in vLLM).
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/api/")
OPEN_PATHS = ("/api/version",)  # like /version


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


# The request bodies of the Anthropic, Responses and Ollama routes, in /openapi.json too.
OTHER_API_BODIES = [
    MessagesRequest,
    CountTokensRequest,
    ResponsesRequest,
    InputTokensRequest,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaEmbedRequest,
    OllamaEmbeddingsRequest,
    OllamaShowRequest,
    OllamaPullRequest,
    OllamaDeleteRequest,
]


def build_app(llm: AsyncLLM, metrics: ServerMetrics, config: ServerConfig) -> FastAPI:
    """The OpenAI-compatible app over a running AsyncLLM (whose on_step feeds ``metrics``)."""
    engine = llm.engine
    serving = OpenAIServing(
        llm,
        list(config.model_names),
        engine.tokenizer,
        engine.max_model_len,
        engine.model.vocab_size,
        ChatFeatures(
            engine.tokenizer,
            config.tool_call_parser,
            config.reasoning_parser,
            config.prompt_normalization,
        ),
        config.sampling_defaults,
    )
    tokenizer = engine.tokenizer
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = None
        if config.log_stats_interval:
            task = asyncio.create_task(_log_stats(metrics, config.log_stats_interval))
        yield
        if task is not None:
            task.cancel()

    # /docs and /redoc come from add_webui_routes, with local assets instead of a CDN's.
    app = FastAPI(
        title="mlxserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.in_flight = serving.in_flight  # for a graceful shutdown (server/shutdown.py)
    install_error_handlers(app)
    doc.install_openapi(
        app,
        [
            CompletionRequest,
            ChatCompletionRequest,
            EmbeddingRequest,
            TokenizeRequest,
            DetokenizeRequest,
            *OTHER_API_BODIES,
        ],
        list(config.model_names),
    )
    limit = config.max_request_body_bytes
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=config.api_keys)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "mlxserve",
            "root": config.model_root or name,
            "parent": None,
            "max_model_len": engine.max_model_len,
        }

    @app.get("/health", responses=_HEALTH_RESPONSES)
    async def health() -> Response:
        if not llm.is_running:
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

    @app.get("/v1/models", response_model=None, responses={200: doc.ok(doc.ModelList)} | doc.ERRORS)
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(n) for n in config.model_names]}

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=None,
        responses={200: doc.ok(doc.ModelCard), 404: doc.BODY_ERRORS[404]} | doc.ERRORS,
    )
    async def retrieve_model(model_id: str) -> dict:
        serving.check_model(model_id)
        return model_card(model_id)

    @app.post(
        "/v1/completions",
        openapi_extra=doc.request_body(CompletionRequest),
        responses=doc.generation_responses(doc.CompletionResponse),
    )
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, limit)
        return await serving.create_completion(request, body)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=doc.request_body(ChatCompletionRequest),
        responses=doc.generation_responses(doc.ChatCompletionResponse),
    )
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, limit)
        return await serving.create_chat_completion(request, body)

    @app.post(
        "/v1/embeddings",
        openapi_extra=doc.request_body(EmbeddingRequest),
        response_model=None,
        responses={200: doc.ok(doc.EmbeddingResponse)} | doc.GENERATE_ERRORS,
    )
    async def embeddings(request: Request) -> Response:
        body = await parse_body(request, EmbeddingRequest, limit)
        return await create_embedding(serving, request, body)

    @app.post(
        "/tokenize",
        openapi_extra=doc.request_body(TokenizeRequest),
        response_model=None,
        responses={200: doc.ok(doc.TokenizeResponse)} | doc.BODY_ERRORS,
    )
    async def tokenize(request: Request) -> dict:
        body = await parse_body(request, TokenizeRequest, limit)
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")

        def encode() -> list[int]:
            if body.prompt is not None:
                add = True if body.add_special_tokens is None else body.add_special_tokens
                return tokenizer.encode(body.prompt, add_special_tokens=add)
            tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
            messages, tools = serving.features.template_inputs(
                [m.to_template() for m in body.messages], tools
            )
            try:
                text = tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                )
            except ValueError as e:
                raise bad_request(str(e), getattr(e, "parameter", None) or "messages") from None
            if body.add_special_tokens:
                return tokenizer.encode(text, add_special_tokens=True)
            return tokenizer.encode_rendered_chat(text)

        def encode_with_strs() -> tuple[list[int], list[str | None] | None]:
            tokens = encode()
            return tokens, [tokenizer.id_to_token(t) for t in tokens] if (
                body.return_token_strs
            ) else None

        tokens, strs = await run_in_threadpool(encode_with_strs)
        out = {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}
        if strs is not None:
            out["token_strs"] = strs
        return out

    @app.post(
        "/detokenize",
        openapi_extra=doc.request_body(DetokenizeRequest),
        response_model=None,
        responses={200: doc.ok(doc.DetokenizeResponse)} | doc.BODY_ERRORS,
    )
    async def detokenize(request: Request) -> dict:
        body = await parse_body(request, DetokenizeRequest, limit)
        serving.check_model(body.model)
        serving.check_token_ids(body.tokens, "tokens")
        text = await run_in_threadpool(tokenizer.decode, body.tokens, False)
        return {"prompt": text}

    from mlx.utils import tree_flatten

    model_size = sum(v.nbytes for _, v in tree_flatten(engine.model.parameters()))
    add_ollama_routes(app, OllamaServing(serving, engine, model_size), limit)
    add_anthropic_routes(app, AnthropicServing(serving), limit)
    add_responses_routes(app, ResponsesServing(serving), limit)
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


class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``) holds one of the
    keys (constant-time)."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") == "OPTIONS"
            or not scope["path"].startswith(PROTECTED_PREFIXES)
            or scope["path"] in OPEN_PATHS
        ):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        # Anthropic's clients send the key as x-api-key instead.
        x_api_key = headers.get(b"x-api-key")
        ok = False
        for key in self.keys:  # no early exit: the time does not depend on which key matched
            ok |= hmac.compare_digest(token.strip(), key) and scheme.lower() == b"bearer"
            if x_api_key is not None:
                ok |= hmac.compare_digest(x_api_key.strip(), key)
        if not ok:
            message = "invalid or missing API key: send the header 'Authorization: Bearer <key>'"
            error = APIError(401, message, code="invalid_api_key")
            body = error.body()
            path = scope["path"]
            if path.startswith("/v1/messages"):  # each API's clients read their own shape
                body = anthropic_error_body(401, message.replace("send the header", "send"))
                body["error"]["message"] += " or 'x-api-key: <key>'"
            elif path.startswith("/api/"):
                body = {"error": message}
            response = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _log_stats(metrics: ServerMetrics, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        line = metrics.log_line()
        if line is not None:
            logger.info(line)
