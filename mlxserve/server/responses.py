"""OpenAI's Responses API (/v1/responses) onto the engine.

A thin translation: ``instructions`` + the conversation of ``previous_response_id`` + ``input``
become chat messages for ChatRun (responses_input.py); the reply, parsed into reasoning,
text and tool calls, becomes output items (responses_output.py), as one Response object or
as the Responses event stream (response.created, response.in_progress, the items' events,
then response.completed / response.incomplete, or error + response.failed).

Field policy (docs/api-fields.md): what changes the output is honoured (sampling, text.format,
tools, reasoning.effort, include of reasoning.encrypted_content), hints and bookkeeping are
accepted (prompt_cache_key, client_metadata, metadata, service_tier, user, ...), and only
what would otherwise be silently wrong is refused, in OpenAI's words (background, prompt,
conversation, moderation, image and file input).

Responses are kept (unless ``store: false``) in a bounded in-memory store, oldest dropped
first, so a follow-up can name its ``previous_response_id``; instructions are not carried
over (as OpenAI's).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxserve.exceptions import ParameterError
from mlxserve.parsers import ToolCall, ToolCallDelta
from mlxserve.sampling_params import (
    INT32_MAX,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutputsParams,
)
from mlxserve.server import openapi as doc
from mlxserve.server import streams
from mlxserve.server.api import API
from mlxserve.server.chat_run import ChatRequest, ChatResult, ChatRun, framed, started
from mlxserve.server.errors import APIError, bad_request
from mlxserve.server.protocol import _Strict, model_defaults
from mlxserve.server.reasoning_effort import effort_template_kwargs
from mlxserve.server.responses_input import (
    ResponsesTools,
    responses_items,
    responses_tool_choice,
    responses_tools,
)
from mlxserve.server.responses_output import ResponseOutput
from mlxserve.server.serving import Serving
from mlxserve.server.streams import TICK, ClientDisconnected, SSEResponse, ticking

# Responses kept for previous_response_id / GET: each holds its conversation's text.
MAX_STORED_RESPONSES = 1000

# include values: the reasoning is returned; the others name items mlxserve never makes.
INCLUDABLE = frozenset(
    {
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)


class TextFormat(_Strict):
    """text.format: plain text, any JSON object, or a JSON schema (enforced by a grammar)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.schema_ if self.schema_ is not None else {})
        return None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: not used


class ReasoningConfig(_Strict):
    """reasoning: the effort is the template's reasoning switch; a summary asked for is the
    reasoning itself (mlxserve writes no separate summary)."""

    effort: str | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


class ResponsesRequest(_Strict):
    """POST /v1/responses: every field of OpenAI's, honoured, accepted or refused."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: none is added
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float = 1.0
    top_p: float = 1.0
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=0)  # limits server-side tools: none run here
    truncation: Literal["auto", "disabled"] | None = None
    # Bookkeeping and hints: accepted, echoed where the Response object has them.
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # one engine-wide prefix cache serves every key
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    context_management: list[dict[str, Any]] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    # Refused when set (check_refused): the answer would be silently wrong.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None

    def check_refused(self) -> None:
        """400 for what mlxserve cannot do and must not pretend to."""
        if self.background:
            raise bad_request(
                "Background mode is not supported by this server: leave background out "
                "(or false) and stream the response instead",
                "background",
            )
        if self.conversation is not None:
            raise bad_request(
                "Conversations are not supported by this server: send the earlier items in "
                "input, or name previous_response_id",
                "conversation",
            )
        if self.prompt is not None:
            raise bad_request(
                "Stored prompt templates are not supported by this server: send the "
                "instructions and input themselves",
                "prompt",
            )
        if self.moderation is not None:
            raise bad_request(
                "Moderation is not supported by this server: leave moderation out", "moderation"
            )
        for i, value in enumerate(self.include or ()):
            if value == "message.output_text.logprobs":
                raise bad_request(
                    "include 'message.output_text.logprobs' is not supported on /v1/responses "
                    "by this server: use /v1/chat/completions with logprobs",
                    f"include.{i}",
                )
            if value not in INCLUDABLE:
                raise bad_request(
                    f"include.{i}: {value!r} is not one of {', '.join(sorted(INCLUDABLE))}",
                    f"include.{i}",
                )

    @property
    def effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning is not None else None

    @property
    def wants_summary(self) -> bool:
        r = self.reasoning
        return r is not None and (r.summary or r.generate_summary) is not None

    def sampling_params(self, defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """SamplingParams; ``defaults``: the model's, for the fields left out."""
        sampling = {"temperature": self.temperature, "top_p": self.top_p}
        sampling |= model_defaults(defaults, self.model_fields_set, sampling)
        max_tokens = self.max_output_tokens
        if max_tokens is None and defaults:
            max_tokens = defaults.get("max_tokens")
        try:
            params = SamplingParams(**sampling, max_tokens=max_tokens)
            if self.text is not None and self.text.format is not None:
                params.structured_outputs = self.text.format.constraint()
        except ParameterError as e:
            name = {"max_tokens": "max_output_tokens"}.get(e.parameter or "", e.parameter)
            if name and name.startswith("structured_outputs"):
                name = "text.format"
            raise bad_request(str(e), name) from None
        return params


class ResponseStore:
    """Stored responses, oldest dropped first: id -> (response, its conversation, input)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict[str, Any]], list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict[str, Any]], inputs: list[dict]) -> None:
        self._items[response["id"]] = (response, conversation, inputs)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(
        self, response_id: str, param: str | None = "previous_response_id"
    ) -> tuple[dict, list[dict[str, Any]], list[dict]]:
        item = self._items.get(response_id)
        if item is None:
            raise APIError(404, f"Response with id {response_id!r} not found.", param)
        return item

    def delete(self, response_id: str) -> None:
        self.get(response_id, param=None)
        del self._items[response_id]

    def find_item(self, item_id: str) -> dict[str, Any] | None:
        """A stored input or output item by id (for item_reference)."""
        for response, _, inputs in reversed(self._items.values()):
            for item in (*response["output"], *inputs):
                if item.get("id") == item_id:
                    return item
        return None


class ResponsesServing:
    """/v1/responses over the server's models (Serving: model checks, in-flight requests)."""

    def __init__(self, serving: Serving, store: ResponseStore | None = None) -> None:
        self.serving = serving
        self.store = store or ResponseStore()

    def retrieve(self, response_id: str) -> dict:
        return self.store.get(response_id, param=None)[0]

    def delete(self, response_id: str) -> dict:
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def input_items(self, response_id: str) -> dict:
        items = self.store.get(response_id, param=None)[2]
        return {
            "object": "list",
            "data": items,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None,
            "has_more": False,
        }

    def _messages(
        self, req: ResponsesRequest
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict]]:
        """(messages to render, the conversation to store, the input items with ids)."""
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            _, history, _ = self.store.get(req.previous_response_id)
        items = (
            [{"type": "message", "role": "user", "content": req.input}]
            if isinstance(req.input, str)
            else req.input
        )
        conversation = history + responses_items(items, self.store.find_item)
        messages = conversation
        if req.instructions:
            messages = [{"role": "system", "content": req.instructions}] + conversation
        inputs = [{"id": "msg_" + uuid.uuid4().hex} | item for item in items]
        return messages, conversation, inputs

    async def count_input_tokens(self, raw: Request, req: ResponsesRequest) -> dict:
        """POST /v1/responses/input_tokens: the prompt's length, as a create would render it."""
        model = await self.serving.model_or_default(req.model)
        params = req.sampling_params(model.sampling_defaults)
        messages, _, _ = self._messages(req)
        tools = responses_tools(req.tools)
        choice = responses_tool_choice(req.tool_choice, tools)
        run = ChatRun(self.serving, model, "resp", "input")
        chat = ChatRequest(
            params,
            messages=messages,
            tools=tools.tools,
            tool_choice=choice,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            template_kwargs=effort_template_kwargs(req.effort, "reasoning.effort"),
        )
        _, ids, _ = await run_in_threadpool(run.prepare, chat)
        return {"object": "response.input_tokens", "input_tokens": len(ids)}

    async def create(self, raw: Request, req: ResponsesRequest) -> Response:
        model = await self.serving.resolve(req.model)
        req.check_refused()
        params = req.sampling_params(model.sampling_defaults)
        template_kwargs = effort_template_kwargs(req.effort, "reasoning.effort")
        messages, conversation, inputs = self._messages(req)
        tools = responses_tools(req.tools)
        choice = responses_tool_choice(req.tool_choice, tools)
        run = ChatRun(self.serving, model, "resp", "input")
        run.field_names = {"structured_outputs": "text.format"}
        chat = ChatRequest(
            params,
            messages=messages,
            tools=tools.tools,
            tool_choice=choice,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            template_kwargs=template_kwargs,
        )
        start = run.start(raw, chat, stream=bool(req.stream))
        if not await started(run, raw, start):
            return Response(status_code=499)
        resp_id = "resp_" + uuid.uuid4().hex
        created = int(time.time())
        out = ResponseOutput(
            tools, req.wants_summary, "reasoning.encrypted_content" in (req.include or ())
        )

        def body(status: str, res: ChatResult | None, reasoning_tokens: int = 0) -> dict:
            return _response(resp_id, created, model.name, req, tools, status, out.output, res) | (
                {"usage": _usage(res, reasoning_tokens)} if res is not None else {}
            )

        async def finish(res: ChatResult) -> dict:
            reasoning = out.reasoning_text()
            num = 0
            if reasoning:  # tokenized off the event loop
                encode = model.tokenizer.encode
                num = len(await run_in_threadpool(encode, reasoning, add_special_tokens=False))
            status = "incomplete" if res.finish_reason == "length" else "completed"
            response = body(status, res, min(num, res.completion_tokens))
            if req.store:
                self.store.put(response, conversation + [_turn(out)], inputs)
            return response

        if not req.stream:
            try:
                res = await run.collect(raw)
            except ClientDisconnected:
                return Response(status_code=499)
            parsed = run.parsed()
            out.reasoning(parsed.reasoning_content)
            out.text(parsed.content)
            for call in parsed.tool_calls:
                out.call(call)
            out.finish()
            return JSONResponse(await finish(res))

        async def events():
            yield out.event("response.created", response=body("in_progress", None))
            yield out.event("response.in_progress", response=body("in_progress", None))
            async for d in ticking(run.parsed_deltas(), streams.KEEPALIVE_S):
                if d is TICK:  # a long prefill: an event, so clients' idle timers restart
                    yield out.event("response.in_progress", response=body("in_progress", None))
                    continue
                for frame in out.reasoning(d.reasoning_content) + out.text(d.content):
                    yield frame
                for tc in d.tool_calls:
                    call = _tool_call(tc)
                    for frame in out.call(call):
                        yield frame
            for frame in out.finish():
                yield frame
            response = await finish(run.result)
            yield out.event(f"response.{response['status']}", response=response)

        def on_error(e: APIError) -> str:
            error = {"code": e.code or e.type, "message": e.message, "param": e.param}
            failed = body("failed", None) | {
                "error": {"code": "server_error", "message": e.message}
            }
            return out.event("error", **error) + out.event("response.failed", response=failed)

        return SSEResponse(framed(events(), run, on_error), run.close)


def _tool_call(delta: ToolCallDelta) -> ToolCall:
    return ToolCall(delta.id or "", delta.name or "", delta.arguments)


def _turn(out: ResponseOutput) -> dict[str, Any]:
    """The assistant turn a response adds to its stored conversation."""
    turn: dict[str, Any] = {"role": "assistant", "content": out.message_text()}
    reasoning = out.reasoning_text()
    if reasoning:
        turn["reasoning_content"] = reasoning
    if out.calls:
        turn["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in out.calls
        ]
    return turn


def _usage(res: ChatResult, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": res.prompt_tokens,
        # Every prompt token computed stays in the prefix cache for later requests.
        "input_tokens_details": {
            "cached_tokens": res.cached_tokens,
            "cache_write_tokens": res.prompt_tokens - res.cached_tokens,
        },
        "output_tokens": res.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": res.prompt_tokens + res.completion_tokens,
    }


def _response(
    resp_id: str,
    created: int,
    model: str,
    req: ResponsesRequest,
    tools: ResponsesTools,
    status: str,
    output: list[dict[str, Any]],
    res: ChatResult | None,
) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    reasoning = req.reasoning.model_dump(exclude_none=True) if req.reasoning else {}
    fmt = req.text.format if req.text is not None else None
    text: dict[str, Any] = {
        "format": {"type": "text"}
        if fmt is None
        else fmt.model_dump(by_alias=True, exclude_none=True)
    }
    if req.text is not None and req.text.verbosity is not None:
        text["verbosity"] = req.text.verbosity
    return {
        "id": resp_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "model": model,
        "output": list(output),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",
        "store": req.store,
        "temperature": req.temperature,
        "text": text,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "top_logprobs": req.top_logprobs,
        "top_p": req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def add_responses_routes(app: FastAPI, serving: Serving, limit: int) -> None:
    """Register /v1/responses and its retrieve, delete, input_items and input_tokens routes
    over ``serving`` (the server's models)."""
    from mlxserve.server.body import parse_body

    responses = ResponsesServing(serving)

    async def create(request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest, limit)
        return await responses.create(request, body)

    async def input_tokens(request: Request) -> dict:
        body = await parse_body(request, InputTokensRequest, limit)
        return await responses.count_input_tokens(request, body)

    async def retrieve(response_id: str) -> dict:
        return responses.retrieve(response_id)

    async def delete(response_id: str) -> dict:
        return responses.delete(response_id)

    async def input_items(response_id: str) -> dict:
        return responses.input_items(response_id)

    sse = "text/event-stream"
    app.add_api_route(
        "/v1/responses",
        create,
        methods=["POST"],
        **doc.other_api_route(ResponsesRequest, doc.ErrorResponse, sse),
    )
    app.add_api_route(
        "/v1/responses/input_tokens",
        input_tokens,
        methods=["POST"],
        **doc.other_api_route(InputTokensRequest, doc.ErrorResponse),
    )
    for method, handler in (("GET", retrieve), ("DELETE", delete)):
        app.add_api_route(
            "/v1/responses/{response_id}",
            handler,
            methods=[method],
            **doc.other_api_route(None, doc.ErrorResponse),
        )
    app.add_api_route(
        "/v1/responses/{response_id}/input_items",
        input_items,
        methods=["GET"],
        **doc.other_api_route(None, doc.ErrorResponse),
    )


class InputTokensRequest(ResponsesRequest):
    """POST /v1/responses/input_tokens: a create's fields (input may be left out)."""

    input: str | list[dict[str, Any]] = ""
    personality: str | None = None


RESPONSES_API = API(
    name="responses",
    add_routes=add_responses_routes,
    prefixes=("/v1/responses",),
    bodies=(ResponsesRequest, InputTokensRequest),
)
