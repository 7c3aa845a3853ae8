"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) onto the engine.

A thin translation: the body becomes chat messages and SamplingParams, run by ChatRun as
any chat completion; the answer goes back as a Message, or as Anthropic's event stream::

    message_start, content_block_start, ping, content_block_delta..., content_block_stop,
    message_delta (stop_reason, usage), message_stop

Errors have Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxserve.exceptions import ParameterError
from mlxserve.sampling_params import INT32_MAX, MAX_STOP, SamplingParams, StructuredOutputsParams
from mlxserve.server import openapi as doc
from mlxserve.server import streams
from mlxserve.server.anthropic_content import (
    ContextEdits,
    anthropic_messages,
    clear_thinking,
    clear_tool_uses,
)
from mlxserve.server.api import API
from mlxserve.server.chat_run import ChatRequest, ChatResult, ChatRun, framed, started
from mlxserve.server.errors import APIError, bad_request, closing_headers
from mlxserve.server.protocol import model_defaults
from mlxserve.server.serving import Serving
from mlxserve.server.streams import TICK, ClientDisconnected, SSEResponse, ticking
from mlxserve.server.tool_messages import anthropic_tool_choice, anthropic_tools, call_input

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

# Every top-level field of the Messages API (the `anthropic` SDK's MessageCreateParams, beta
# included, and the sampling fields the API still takes) -> what mlxserve does with it
# (docs/api-fields.md): "honoured" changes the output, "accepted" is metadata or a hint for
# Anthropic's own infrastructure, "refused" is a 400 because ignoring it would be wrong.
FIELDS: dict[str, str] = {
    "model": "honoured",
    "messages": "honoured",
    "max_tokens": "honoured",
    "system": "honoured",
    "stop_sequences": "honoured",
    "stream": "honoured",
    "temperature": "honoured",
    "top_p": "honoured",
    "top_k": "honoured",
    "tools": "honoured",
    "tool_choice": "honoured",
    "thinking": "honoured",
    "output_config": "honoured",
    "context_management": "honoured",
    "metadata": "accepted",
    "service_tier": "accepted",
    "container": "accepted",
    "cache_control": "accepted",
    "diagnostics": "accepted",
    "inference_geo": "accepted",
    "speed": "accepted",
    "betas": "accepted",
    "user_profile_id": "accepted",
    "workspace_id": "accepted",
    "mcp_servers": "accepted",
    "billing_policy": "accepted",
    "fallback_credit_token": "accepted",
    "fallbacks": "accepted",
    "compaction": "accepted",
    "thread": "refused",
}
EFFORTS = ("low", "medium", "high", "xhigh", "max")
THINKING_TYPES = ("enabled", "adaptive", "between_tools", "disabled")
EDIT_TYPES = ("clear_thinking_20251015", "clear_tool_uses_20250919", "compact_20260112")
ROLES = ("user", "assistant", "system")


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]
    clear_at: Literal["next_user_message", "never"] | None = None  # system messages
    output_config: dict[str, Any] | None = None  # system messages: per-turn hints


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    # Accepted: metadata and hints for Anthropic's own infrastructure (FIELDS).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: str | dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # prefix caching here is automatic
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    betas: list[str] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    billing_policy: dict[str, Any] | None = None
    fallback_credit_token: str | dict[str, Any] | None = None
    fallbacks: list[Any] | dict[str, Any] | None = None
    compaction: dict[str, Any] | None = None
    thread: dict[str, Any] | None = None

    def check(self) -> None:
        """400 for what cannot be honoured (FIELDS "refused", bad thinking / effort / edits)."""
        if self.thread is not None:
            raise bad_request(
                "thread: server-held conversation state is not supported by this server; "
                "send the whole conversation in messages",
                "thread",
            )
        kind = (self.thinking or {}).get("type")
        if self.thinking is not None and kind not in THINKING_TYPES:
            raise bad_request(_tag_error("thinking", kind, THINKING_TYPES), "thinking.type")
        if kind == "enabled":
            budget = self.thinking.get("budget_tokens")
            if not isinstance(budget, int) or isinstance(budget, bool):
                raise bad_request(
                    "thinking.enabled.budget_tokens: Field required", "thinking.budget_tokens"
                )
        effort = (self.output_config or {}).get("effort")
        if effort is not None and effort not in EFFORTS:
            raise bad_request(
                f"output_config.effort: Input should be {_one_of(EFFORTS)}", "output_config.effort"
            )
        fmt = (self.output_config or {}).get("format")
        if fmt is not None and (fmt.get("type") != "json_schema" or "schema" not in fmt):
            raise bad_request(
                "output_config.format: Input should be {'type': 'json_schema', 'schema': ...}",
                "output_config.format",
            )
        for i, edit in enumerate(self.edits()):
            if not isinstance(edit, dict) or edit.get("type") not in EDIT_TYPES:
                got = edit.get("type") if isinstance(edit, dict) else None
                where = f"context_management.edits.{i}"
                raise bad_request(_tag_error(where, got, EDIT_TYPES), where)

    def edits(self) -> list[Any]:
        return list((self.context_management or {}).get("edits") or ())

    def chat_messages(self) -> list[dict[str, Any]]:
        """System first (blocks joined), then the turns, in OpenAI chat terms."""
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            text = (
                system
                if isinstance(system, str)
                else "".join(
                    str(b.get("text", "")) for b in system if b.get("type", "text") == "text"
                )
            )
            out.append({"role": "system", "content": text})
        turns = [m.model_dump(exclude_none=True) for m in self.messages]
        return out + anthropic_messages(turns)

    def tool_args(self) -> dict[str, Any]:
        """ChatRun's tools, tool_choice and parallel_tool_calls for this body."""
        tools, dropped = anthropic_tools(self.tools)
        dropped += [str(s.get("name", "mcp server")) for s in self.mcp_servers or ()]
        if dropped:
            logger.warning(
                "anthropic: left out %d server tool(s) (%s): this server runs custom tools only",
                len(dropped),
                ", ".join(dropped),
            )
        choice, parallel = anthropic_tool_choice(self.tool_choice, tools, dropped)
        return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's reasoning switches: ``thinking`` and ``output_config.effort``."""
        kwargs: dict[str, Any] = {}
        kind = (self.thinking or {}).get("type")
        if kind is not None:
            kwargs["enable_thinking"] = kind != "disabled"
        if kind == "enabled":
            kwargs["thinking_budget"] = self.thinking["budget_tokens"]
        effort = (self.output_config or {}).get("effort")
        if effort is not None:
            kwargs["reasoning_effort"] = {"xhigh": "high", "max": "high"}.get(effort, effort)
        return kwargs

    @property
    def shows_thinking(self) -> bool:
        return (self.thinking or {}).get("display") != "omitted"


class MessagesRequest(_Body):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stream: bool = False

    def sampling_params(self, defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """SamplingParams; ``defaults``: the model's, for the fields left out."""
        sampling = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        sampling |= model_defaults(defaults, self.model_fields_set, sampling)
        fmt = (self.output_config or {}).get("format")
        try:
            return SamplingParams(
                **sampling,
                max_tokens=self.max_tokens,
                stop=self.stop_sequences,
                structured_outputs=StructuredOutputsParams(json=fmt["schema"]) if fmt else None,
            )
        except ParameterError as e:
            name = {"stop": "stop_sequences", "structured_outputs": "output_config.format"}
            raise bad_request(str(e), name.get(e.parameter or "", e.parameter)) from None


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens."""


def _one_of(values: tuple[str, ...]) -> str:
    return ", ".join(repr(v) for v in values[:-1]) + f" or {values[-1]!r}"


def _tag_error(where: str, got: Any, tags: tuple[str, ...]) -> str:
    """Anthropic's words for a tagged union given an unknown ``type``."""
    expected = ", ".join(repr(t) for t in tags)
    return (
        f"{where}: Input tag {got!r} found using 'type' does not match any of the "
        f"expected tags: {expected}"
    )


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """A pydantic error in Anthropic's words ("max_tokens: Field required"), and its field."""
    parts, first = [], None
    for err in e.errors():
        loc = [str(x) for x in err.get("loc", ()) if not str(x).startswith(("list[", "dict["))]
        loc = [x for x in loc if x not in ("str", "int", "float", "bool")]
        name = ".".join(loc) or "body"
        first = first or name
        parts.append(f"{name}: {err.get('msg')}")
    return "; ".join(dict.fromkeys(parts)), first


def signature(thinking: str) -> str:
    """An opaque signature for a thinking block (clients send it back unchanged)."""
    return "mlxserve-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


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
    """/v1/messages over the server's models (Serving: model checks, in-flight requests)."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    def _inputs(
        self, req: _Body, run: ChatRun, tool_args: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None, int]:
        """(messages after the context edits, the response's ``context_management``, the
        prompt's token count before the edits) -- call in a worker thread."""
        messages = req.chat_messages()
        edits = req.edits()
        if not edits:
            return messages, None, 0
        chat = ChatRequest(SamplingParams(), messages=copy.deepcopy(messages), **tool_args)
        original = len(run.prepare(chat)[1])
        applied = []
        for edit in edits:
            done = ContextEdits()
            if edit["type"] == "clear_thinking_20251015":
                clear_thinking(messages, edit.get("keep"), done)
                cleared = _num_tokens(run.model.tokenizer, done.cleared_thinking)
                applied.append(
                    {
                        "type": edit["type"],
                        "cleared_thinking_turns": done.cleared_thinking_turns,
                        "cleared_input_tokens": cleared,
                    }
                )
            elif edit["type"] == "clear_tool_uses_20250919":
                clear_tool_uses(messages, edit, original, done)
                cleared = _num_tokens(run.model.tokenizer, done.cleared_tool_text)
                least = (edit.get("clear_at_least") or {}).get("value", 0)
                if done.cleared_tool_uses and cleared < least:  # not worth it: undo
                    messages = req.chat_messages()
                    continue
                applied.append(
                    {
                        "type": edit["type"],
                        "cleared_tool_uses": done.cleared_tool_uses,
                        "cleared_input_tokens": cleared,
                    }
                )
            # compact_20260112 (a server-side summary) is not done: the history stays whole
        return messages, {"applied_edits": applied}, original

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, Any]:
        model = await self.serving.resolve(req.model)
        req.check()
        run = ChatRun(self.serving, model, "count")
        tool_args = req.tool_args()
        messages, edits, original = await run_in_threadpool(self._inputs, req, run, tool_args)
        chat = ChatRequest(SamplingParams(), messages=messages, **tool_args, **_kwargs(req))
        _, ids, _ = await run_in_threadpool(run.prepare, chat)
        body: dict[str, Any] = {"input_tokens": len(ids)}
        if edits is not None:
            body["context_management"] = {"original_input_tokens": original}
        return body

    async def messages(self, raw: Request, req: MessagesRequest) -> Response:
        model = await self.serving.resolve(req.model)
        req.check()
        params = req.sampling_params(model.sampling_defaults)
        run = ChatRun(self.serving, model, "msg", "messages")
        run.field_names["structured_outputs"] = "output_config.format"
        tool_args = req.tool_args()
        messages, edits, _ = await run_in_threadpool(self._inputs, req, run, tool_args)
        chat = ChatRequest(params, messages=messages, **tool_args, **_kwargs(req))
        start = run.start(raw, chat, stream=bool(req.stream))
        if not await started(run, raw, start):
            return Response(status_code=499)
        head = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant"}
        head["model"] = model.name
        extra = {"context_management": edits} if edits is not None else {}
        if not req.stream:
            try:
                res = await run.collect(raw)
            except ClientDisconnected:
                return Response(status_code=499)
            parsed = run.parsed()
            content = []
            if parsed.reasoning_content:
                thinking = parsed.reasoning_content
                content.append(
                    {
                        "type": "thinking",
                        "thinking": thinking if req.shows_thinking else "",
                        "signature": signature(thinking),
                    }
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
            return JSONResponse(body | {"usage": usage(res)} | extra)
        frames = framed(
            _events(run, head, extra, req.shows_thinking),
            run,
            lambda e: event("error", error_body(e.status, e.message)),
        )
        return SSEResponse(frames, run.close)


def _num_tokens(tokenizer, texts: list[str]) -> int:
    return sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts)


def _kwargs(req: _Body) -> dict[str, Any]:
    kwargs = req.template_kwargs()
    return {"template_kwargs": kwargs} if kwargs else {}


async def _events(
    run: ChatRun, head: dict[str, Any], extra: dict[str, Any], shows_thinking: bool
) -> AsyncIterator[str]:
    """Anthropic's event stream of one reply: a block per kind of output, in order.

    message_start waits until the engine knows how much of the prompt came from the prefix
    cache (its usage splits input_tokens from cache_read_input_tokens): the first output,
    or in a long prefill the first keepalive after the request was scheduled. Pings follow
    while the first output is still computed: clients time out between events (Claude
    Code after 300 s), not only between bytes.
    """
    index, open_kind, num_calls, thinking = -1, None, 0, ""

    def block_start(kind: str, block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        frames = block_stop() if open_kind else []
        index, open_kind = index + 1, kind
        frames.append(
            event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        )
        return frames

    def block_stop() -> list[str]:
        frames = []
        if open_kind == "thinking":
            frames.append(
                block_delta({"type": "signature_delta", "signature": signature(thinking)})
            )
        frames.append(event("content_block_stop", {"type": "content_block_stop", "index": index}))
        return frames

    def block_delta(delta: dict[str, Any]) -> str:
        return event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        )

    def message_start() -> list[str]:
        start = head | {"content": [], "stop_reason": None, "stop_sequence": None}
        start_usage = usage(run.result) | {"output_tokens": 0}
        message = start | {"usage": start_usage}
        return [
            event("message_start", {"type": "message_start", "message": message}),
            event("ping", {"type": "ping"}),
        ]

    began = False
    async for d in ticking(run.parsed_deltas(announce_start=True), streams.KEEPALIVE_S):
        if d is TICK:
            if began:
                yield event("ping", {"type": "ping"})
            elif run.scheduled():
                began = True
                for f in message_start():
                    yield f
            continue
        if not began:
            began = True
            for f in message_start():
                yield f
        if d.reasoning_content:
            if open_kind != "thinking":
                thinking = ""
                for f in block_start(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                ):
                    yield f
            thinking += d.reasoning_content
            if shows_thinking:
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
    if not began:
        for f in message_start():
            yield f
    if open_kind is None:  # an empty reply: one empty text block
        for f in block_start("text", {"type": "text", "text": ""}):
            yield f
    for f in block_stop():
        yield f
    reason, sequence = stop_reason(run.result, num_calls > 0)
    delta = {"stop_reason": reason, "stop_sequence": sequence}
    body = {"type": "message_delta", "delta": delta, "usage": usage(run.result)} | extra
    yield event("message_delta", body)
    yield event("message_stop", {"type": "message_stop"})


def usage(res: ChatResult) -> dict[str, int]:
    """Anthropic's usage: the prompt is input_tokens + cache_read_input_tokens +
    cache_creation_input_tokens, so input_tokens leaves out what the prefix cache held.
    cache_creation_input_tokens is 0: caching here is automatic and costs the client nothing."""
    return {
        "input_tokens": res.prompt_tokens - res.cached_tokens,
        "output_tokens": res.completion_tokens,
        "cache_read_input_tokens": res.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _as_api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    logger.exception("internal error while handling a request")
    return APIError(500, f"internal server error: {type(e).__name__}: {e}")


def parse_anthropic(data: Any, model: type[_Body]) -> _Body:
    """A JSON body as ``model``, with Anthropic's error words (null: not given)."""
    if not isinstance(data, dict):
        raise bad_request("body: Input should be a valid dictionary", "body")
    data = {k: v for k, v in data.items() if v is not None}
    messages = data.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        role = message.get("role") if isinstance(message, dict) else None
        if role is not None and role not in ROLES:
            raise bad_request(
                f"messages.{i}: Unexpected role {json.dumps(role)}. The Messages API accepts "
                'a top-level `system` parameter, and "user", "assistant" or "system" as an '
                "input message role; other roles are not supported",
                f"messages.{i}.role",
            )
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, name = validation_message(e)
        raise bad_request(message, name) from None


def add_anthropic_routes(app: FastAPI, serving: Serving, limit: int) -> None:
    """Register /v1/messages and /v1/messages/count_tokens over ``serving`` (the server's
    models); errors leave in Anthropic's shape.

    ``?beta=true`` and the ``anthropic-beta`` / ``anthropic-version`` headers are accepted:
    every beta feature this server has is on for every request.
    """
    from mlxserve.server.body import parse_json, read_body

    anthropic = AnthropicServing(serving)

    async def messages(request: Request) -> Response:
        try:
            data = parse_json(await read_body(request, limit))
            return await anthropic.messages(request, parse_anthropic(data, MessagesRequest))
        except Exception as e:  # noqa: BLE001 -- every error in Anthropic's shape
            return error_response(_as_api_error(e))

    async def count_tokens(request: Request) -> Response:
        try:
            data = parse_json(await read_body(request, limit))
            body = parse_anthropic(data, CountTokensRequest)
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


ANTHROPIC_API = API(
    name="anthropic",
    add_routes=add_anthropic_routes,
    prefixes=("/v1/messages",),
    bodies=(MessagesRequest, CountTokensRequest),
    error_response=error_response,
    auth_hint="send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
)
