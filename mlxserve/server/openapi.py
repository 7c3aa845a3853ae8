"""/openapi.json: every request body and response the server sends, as JSON schemas.

The POST routes read their bodies by hand (mlxserve.server.body: size limit, strict JSON,
null meaning "not given"), so FastAPI cannot see them; this module documents each body from
its pydantic model, and each response shape from the models below, which exist only for the
documentation. tests/test_server_schemathesis.py checks real responses against them.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"
DESCRIPTION = (
    "OpenAI-compatible API of mlxserve. Request fields set to null count as not given; "
    'types are strict ("10" is not an integer, true is not 1; 10.0 is the integer 10, as '
    "JSON Schema reads it)."
)


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(_Doc):
    """Every error: OpenAI's shape."""

    error: ErrorDetail


class PromptTokensDetails(_Doc):
    cached_tokens: int


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


FinishReason = Literal["stop", "length", "abort", "tool_calls", "error"]


class CompletionLogprobsDoc(_Doc):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: CompletionLogprobsDoc | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None


class CompletionResponse(_Doc):
    """POST /v1/completions without stream."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    content: list[TokenLogprob]
    refusal: None


class FunctionCall(_Doc):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallDoc(_Doc):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Doc):
    role: Literal["assistant"]
    content: str | None  # null when the reply is only tool calls
    tool_calls: list[ToolCallDoc] | None = None
    reasoning_content: str | None = None  # with a reasoning parser


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None


class ChatCompletionResponse(_Doc):
    """POST /v1/chat/completions without stream."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeResponse(_Doc):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Doc):
    prompt: str


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: None
    max_model_len: int | None = None  # absent for a model not loaded yet


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class EmbeddingData(_Doc):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(_Doc):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Doc):
    """POST /v1/embeddings."""

    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class Version(_Doc):
    version: str


class CacheTier(_Doc):
    name: str
    num_blocks: int
    num_blocks_in_use: int
    num_cached_blocks: int
    bytes_per_block: int
    cached_bytes: int
    hit_tokens: int


class ModelCacheStats(_Doc):
    model: str
    enabled: bool
    block_size: int
    tiers: list[CacheTier]
    query_tokens: int
    hit_tokens: int
    num_requests: int
    num_requests_hit: int
    hit_rate: float


class CacheStats(_Doc):
    data: list[ModelCacheStats]


def ok(model: type[BaseModel]) -> dict[str, Any]:
    """A documented 200 JSON response (the route builds its body itself)."""
    return {"description": "Successful response", "model": model}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "model": ErrorResponse}


# What any route may answer besides its success (401 only with --api-key).
ERRORS = {
    401: _error("Missing or wrong API key"),
    500: _error("Internal error; the connection is closed after it"),
}
BODY_ERRORS = ERRORS | {
    400: _error("Invalid request: malformed JSON, an unsupported field or a bad value"),
    404: _error("Unknown model"),
    413: _error("Request body larger than --max-request-body-bytes"),
}
GENERATE_ERRORS = BODY_ERRORS | {503: _error("The server is shutting down")}


# One server-sent event (OpenAPI 3.1 has no itemSchema, so the schema is read per event, as
# schemathesis does): its data is a JSON chunk, or "[DONE]" at the end.
_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The responses of a generation route: JSON, or an event stream with stream=true."""
    stream = {"text/event-stream": {"schema": _EVENT}}
    ok = {"description": "The completion (JSON), or an event stream", "model": model}
    return {200: ok | {"content": stream}} | GENERATE_ERRORS


class AnthropicErrorDetail(_Doc):
    type: str
    message: str


class AnthropicError(_Doc):
    """Every error of /v1/messages*: Anthropic's shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class OllamaError(_Doc):
    """Every error of /api/*: Ollama's shape."""

    error: str


def other_api_route(
    body: type[BaseModel] | None, error: type[BaseModel], stream_type: str | None = None
) -> dict[str, Any]:
    """``add_api_route`` arguments documenting a route of another API (Anthropic, Responses,
    Ollama): its request body, a 200 (JSON, or a ``stream_type`` stream when the body asks
    for one) and its errors, in that API's shape."""
    content: dict[str, Any] = {"application/json": {"schema": {}}}
    if stream_type == "text/event-stream":
        content[stream_type] = {"schema": _EVENT}
    elif stream_type is not None:
        content[stream_type] = {"schema": {"type": "string"}}
    responses: dict[int | str, dict[str, Any]] = {
        200: {"description": "Successful response", "content": content},
        "default": {"description": "An error, in this API's shape", "model": error},
    }
    extra = request_body(body) if body is not None else None
    return {"include_in_schema": True, "responses": responses, "openapi_extra": extra}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting a JSON request body parsed by hand."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(
    app: FastAPI, body_models: list[type[BaseModel]], model_names: list[str]
) -> None:
    """Serve an /openapi.json that also holds the hand-parsed request bodies' schemas
    (their ``model`` field, and /api/copy's ``source``: one of the served names)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, routes=app.routes, description=DESCRIPTION
            )
            _, defs = models_json_schema(
                [(m, "validation") for m in body_models], ref_template=_REF
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(defs.get("$defs", {}))
            for model in body_models:
                component = components[model.__name__]
                properties, required = component["properties"], component.get("required", [])
                for name, field in properties.items():
                    if name not in required:  # a required field's null is a missing field
                        properties[name] = _nullable(field)
                for key in ("model", "source"):  # /api/copy's source: a served model too
                    field = properties.get(key)
                    if field is not None:
                        field["enum"] = [*model_names] + ([] if key in required else [None])
            _drop_422(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _nullable(field: dict[str, Any]) -> dict[str, Any]:
    """A top-level body field that also takes null, which the server reads as "not given"
    (mlxserve.server.body.parse_model), whatever the field's own type."""
    options = field.get("anyOf", [field])
    if any(o.get("type") == "null" for o in options):
        return field
    outer = {k: field.pop(k) for k in ("title", "description", "default") if k in field}
    return outer | {"anyOf": [field, {"type": "null"}]}


def _drop_422(schema: dict[str, Any]) -> None:
    # FastAPI documents a 422 for path parameters; validation errors here are 400s.
    for item in schema.get("paths", {}).values():
        for operation in item.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
