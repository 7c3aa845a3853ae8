"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) onto the engine.

A thin translation: the body becomes chat messages and SamplingParams, run by ChatRun as
any chat completion; the answer goes back as a Message, or as Anthropic's event stream::

    message_start, content_block_start, ping, content_block_delta..., content_block_stop,
    message_delta (stop_reason, usage), message_stop

Errors have Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxserve.exceptions import ParameterError
from mlxserve.sampling_params import INT32_MAX, MAX_STOP, SamplingParams
from mlxserve.server import openapi as doc
from mlxserve.server.chat_run import ChatResult, ChatRun, framed, started
from mlxserve.server.errors import APIError, add_error_shape, bad_request, closing_headers
from mlxserve.server.protocol import _Strict, model_defaults
from mlxserve.server.streams import ClientDisconnected, SSEResponse
from mlxserve.server.tool_messages import (
    anthropic_messages,
    anthropic_tool_choice,
    anthropic_tools,
    call_input,
)

logger = logging.getLogger("mlxserve.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here
    citations: list[dict[str, Any]] | None = None


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class _Body(_Strict):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    # Reasoning follows the model (its reasoning parser); "thinking" blocks carry it.
    thinking: dict[str, Any] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """System first (blocks joined), then the turns, in OpenAI chat terms."""
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            out.append({"role": "system", "content": text})
        return out + anthropic_messages(self.messages)

    def tool_args(self) -> dict[str, Any]:
        """ChatRun's tools, tool_choice and parallel_tool_calls for this body."""
        choice, parallel = anthropic_tool_choice(self.tool_choice)
        return {
            "tools": anthropic_tools(self.tools),
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
        }


class MessagesRequest(_Body):
    """POST /v1/messages."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stream: bool = False
    metadata: dict[str, Any] | None = None  # user_id, for the caller's bookkeeping: not used

    def sampling_params(self, defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """SamplingParams; ``defaults``: the model's, for the fields left out."""
        sampling = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        sampling |= model_defaults(defaults, self.model_fields_set, sampling)
        try:
            return SamplingParams(
                **sampling,
                max_tokens=self.max_tokens,
                stop=self.stop_sequences,
            )
        except ParameterError as e:
            name = {"stop": "stop_sequences"}.get(e.parameter or "", e.parameter)
            raise bad_request(str(e), name) from None


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens."""


def stop_reason(res: ChatResult, called_tools: bool = False) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for how the generation ended."""
    if called_tools and res.finish_reason == "stop":
        return "tool_use", None
    if res.finish_reason == "length":
        return "max_tokens", None
    if isinstance(res.stop_reason, str):
        return "stop_sequence", res.stop_reason
    return "end_turn", None


def error_body(status: int, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
    }


def error_response(e: APIError) -> JSONResponse:
    """An error in Anthropic's shape."""
    return JSONResponse(
        error_body(e.status, e.message), status_code=e.status, headers=closing_headers(e.status)
    )


def event(name: str, data: dict[str, Any]) -> str:
    """One server-sent event with its name (Anthropic's SDKs dispatch on it)."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class AnthropicServing:
    """/v1/messages over the OpenAI serving object (its engine, checks and limits)."""

    def __init__(self, serving) -> None:
        self.serving = serving

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        self.serving.check_model(req.model)
        run = ChatRun(self.serving, "count")
        _, ids, _ = await run_in_threadpool(
            run.prepare, req.chat_messages(), SamplingParams(), **req.tool_args()
        )
        return {"input_tokens": len(ids)}

    async def messages(self, raw: Request, req: MessagesRequest) -> Response:
        model = self.serving.check_model(req.model)
        params = req.sampling_params(self.serving.sampling_defaults)
        run = ChatRun(self.serving, "msg", "messages")
        start = run.start(raw, params, messages=req.chat_messages(), **req.tool_args())
        if not await started(run, raw, start):
            return Response(status_code=499)
        head = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant"}
        head["model"] = model
        if not req.stream:
            try:
                res = await run.collect(raw)
            except ClientDisconnected:
                return Response(status_code=499)
            parsed = run.parsed()
            content = []
            if parsed.reasoning_content:
                content.append(
                    {"type": "thinking", "thinking": parsed.reasoning_content, "signature": ""}
                )
            if parsed.content or not parsed.tool_calls:
                content.append({"type": "text", "text": parsed.content})
            for call in parsed.tool_calls:
                content.append(
                    {
                        "type": "tool_use",
                        "id": call.id,
                        "name": call.name,
                        "input": call_input(call.arguments),
                    }
                )
            reason, sequence = stop_reason(res, bool(parsed.tool_calls))
            body = head | {"content": content, "stop_reason": reason, "stop_sequence": sequence}
            return JSONResponse(body | {"usage": _usage(res)})
        frames = framed(
            _events(run, head), run, lambda e: event("error", error_body(e.status, e.message))
        )
        return SSEResponse(frames, run.close)


async def _events(run: ChatRun, head: dict[str, Any]) -> AsyncIterator[str]:
    """Anthropic's event stream of one reply: a block per kind of output, in order."""
    start = head | {"content": [], "stop_reason": None, "stop_sequence": None}
    usage = _usage(run.result) | {"output_tokens": 0}
    yield event("message_start", {"type": "message_start", "message": start | {"usage": usage}})
    yield event("ping", {"type": "ping"})
    index, open_kind, num_calls = -1, None, 0

    def block_start(kind: str, block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        frames = (
            [event("content_block_stop", {"type": "content_block_stop", "index": index})]
            if open_kind
            else []
        )
        index, open_kind = index + 1, kind
        frames.append(
            event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        )
        return frames

    def block_delta(delta: dict[str, Any]) -> str:
        return event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        )

    async for d in run.parsed_deltas():
        if d.reasoning_content:
            if open_kind != "thinking":
                for f in block_start(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                ):
                    yield f
            yield block_delta({"type": "thinking_delta", "thinking": d.reasoning_content})
        if d.content:
            if open_kind != "text":
                for f in block_start("text", {"type": "text", "text": ""}):
                    yield f
            yield block_delta({"type": "text_delta", "text": d.content})
        for tc in d.tool_calls:
            if tc.id is not None:  # a new call: its own block
                num_calls += 1
                block = {"type": "tool_use", "id": tc.id, "name": tc.name, "input": {}}
                for f in block_start("tool_use", block):
                    yield f
            if tc.arguments:
                yield block_delta({"type": "input_json_delta", "partial_json": tc.arguments})
    if open_kind is None:  # an empty reply: one empty text block
        for f in block_start("text", {"type": "text", "text": ""}):
            yield f
    yield event("content_block_stop", {"type": "content_block_stop", "index": index})
    reason, sequence = stop_reason(run.result, num_calls > 0)
    delta = {"stop_reason": reason, "stop_sequence": sequence}
    out_usage = {"output_tokens": run.result.completion_tokens}
    yield event("message_delta", {"type": "message_delta", "delta": delta, "usage": out_usage})
    yield event("message_stop", {"type": "message_stop"})


def _usage(res: ChatResult) -> dict[str, int]:
    return {
        "input_tokens": res.prompt_tokens,
        "output_tokens": res.completion_tokens,
        "cache_read_input_tokens": res.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _as_api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    logger.exception("internal error while handling a request")
    return APIError(500, f"internal server error: {type(e).__name__}: {e}")


def add_anthropic_routes(app, anthropic: AnthropicServing, limit: int) -> None:
    """Register /v1/messages and /v1/messages/count_tokens; errors leave in Anthropic's shape."""
    from mlxserve.server.body import parse_body

    add_error_shape(app, "/v1/messages", error_response)

    async def messages(request: Request) -> Response:
        try:
            body = await parse_body(request, MessagesRequest, limit)
            return await anthropic.messages(request, body)
        except Exception as e:  # noqa: BLE001 -- every error in Anthropic's shape
            return error_response(_as_api_error(e))

    async def count_tokens(request: Request) -> Response:
        try:
            body = await parse_body(request, CountTokensRequest, limit)
            return JSONResponse(await anthropic.count_tokens(body))
        except Exception as e:  # noqa: BLE001 -- every error in Anthropic's shape
            return error_response(_as_api_error(e))

    sse = "text/event-stream"
    app.add_api_route(
        "/v1/messages",
        messages,
        methods=["POST"],
        **doc.other_api_route(MessagesRequest, doc.AnthropicError, sse),
    )
    app.add_api_route(
        "/v1/messages/count_tokens",
        count_tokens,
        methods=["POST"],
        **doc.other_api_route(CountTokensRequest, doc.AnthropicError),
    )
