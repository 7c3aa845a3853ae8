"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) onto the engine.

A thin translation: ``instructions`` + the conversation of ``previous_response_id`` + ``input``
become chat messages for ChatRun; the answer is a Response object with one output message, or
the Responses event stream::

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta..., response.output_text.done,
    response.content_part.done, response.output_item.done, response.completed

Responses are kept (unless ``store: false``) in a bounded in-memory store, oldest dropped
first, so a follow-up can name its ``previous_response_id``; instructions are not carried
over (as OpenAI's).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxserve.exceptions import ParameterError
from mlxserve.parsers import ToolCall
from mlxserve.sampling_params import INT32_MAX, SamplingParams, StructuredOutputsParams
from mlxserve.server import openapi as doc
from mlxserve.server.chat_run import ChatResult, ChatRun, framed, started
from mlxserve.server.errors import APIError, bad_request
from mlxserve.server.protocol import _Strict, model_defaults
from mlxserve.server.streams import ClientDisconnected, SSEResponse
from mlxserve.server.tool_messages import responses_items, responses_tool_choice, responses_tools

# Responses kept for previous_response_id / GET: each holds its conversation's text.
MAX_STORED_RESPONSES = 1000


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
    verbosity: str | None = None


class ResponsesRequest(_Strict):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float = 1.0
    top_p: float = 1.0
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # an end-user id for the caller's own bookkeeping; not used
    truncation: Literal["disabled"] | None = None

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

    def tool_args(self) -> dict[str, Any]:
        """ChatRun's tools, tool_choice and parallel_tool_calls for this body."""
        return {
            "tools": responses_tools(self.tools),
            "tool_choice": responses_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls is not False,
        }


class ResponseStore:
    """Stored responses, oldest dropped first: id -> (response object, its conversation)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict[str, str]]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict[str, str]]) -> None:
        self._items[response["id"]] = (response, conversation)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(
        self, response_id: str, param: str | None = "previous_response_id"
    ) -> tuple[dict, list[dict[str, str]]]:
        item = self._items.get(response_id)
        if item is None:
            raise APIError(404, f"no stored response with id {response_id!r}", param)
        return item


class ResponsesServing:
    """/v1/responses over the OpenAI serving object (its engine, checks and limits)."""

    def __init__(self, serving, store: ResponseStore | None = None) -> None:
        self.serving = serving
        self.store = store or ResponseStore()

    def retrieve(self, response_id: str) -> dict:
        response, _ = self.store.get(response_id, param=None)
        return response

    async def create(self, raw: Request, req: ResponsesRequest) -> Response:
        model = self.serving.check_model(req.model)
        params = req.sampling_params(self.serving.sampling_defaults)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            _, history = self.store.get(req.previous_response_id)
        items = (
            [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
        )
        conversation = history + responses_items(items)
        messages = conversation
        if req.instructions:
            messages = [{"role": "system", "content": req.instructions}] + conversation
        run = ChatRun(self.serving, "resp", "input")
        run.field_names = {"structured_outputs": "text.format"}
        start = run.start(raw, params, messages=messages, **req.tool_args())
        if not await started(run, raw, start):
            return Response(status_code=499)
        resp_id = "resp_" + uuid.uuid4().hex
        base = _response(resp_id, model, req, "in_progress", [], None)

        def finish(res: ChatResult, output: list[dict[str, Any]], calls: list[ToolCall]) -> dict:
            status = "incomplete" if res.finish_reason == "length" else "completed"
            body = _response(resp_id, model, req, status, output, res)
            if req.store:
                text = "".join(
                    p["text"]
                    for item in output
                    if item["type"] == "message"
                    for p in item["content"]
                )
                turn: dict[str, Any] = {"role": "assistant", "content": text}
                if calls:
                    turn["tool_calls"] = [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        }
                        for c in calls
                    ]
                self.store.put(body, conversation + [turn])
            return body

        if not req.stream:
            try:
                res = await run.collect(raw)
            except ClientDisconnected:
                return Response(status_code=499)
            parsed = run.parsed()
            output = []
            if parsed.reasoning_content:
                output.append(_reasoning(parsed.reasoning_content))
            if parsed.content or not parsed.tool_calls:
                output.append(_message("msg_" + uuid.uuid4().hex, parsed.content, "completed"))
            output += [_function_call(c) for c in parsed.tool_calls]
            return JSONResponse(finish(res, output, parsed.tool_calls))

        async def events():
            seq = iter(range(1 << 62))

            def event(kind: str, **data: Any) -> str:
                payload = {"type": kind, "sequence_number": next(seq)} | data
                return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

            yield event("response.created", response=base)
            yield event("response.in_progress", response=base)
            output: list[dict[str, Any]] = []
            calls: list[ToolCall] = []
            message: dict[str, Any] | None = None  # the open output message
            reasoning = ""

            def close_message() -> list[str]:
                nonlocal message
                if message is None:
                    return []
                where = {
                    "item_id": message["id"],
                    "output_index": len(output) - 1,
                    "content_index": 0,
                }
                text = message["content"][0]["text"]
                message["status"] = "completed"
                frames = [
                    event("response.output_text.done", **where, text=text, logprobs=[]),
                    event("response.content_part.done", **where, part=_text_part(text)),
                    event(
                        "response.output_item.done",
                        output_index=where["output_index"],
                        item=message,
                    ),
                ]
                message = None
                return frames

            def close_reasoning() -> list[str]:
                nonlocal reasoning
                if not reasoning:
                    return []
                item = _reasoning(reasoning)
                output.append(item)
                reasoning = ""
                index = len(output) - 1
                return [
                    event("response.output_item.added", output_index=index, item=item),
                    event("response.output_item.done", output_index=index, item=item),
                ]

            async for d in run.parsed_deltas():
                reasoning += d.reasoning_content
                if d.content:
                    for f in close_reasoning():
                        yield f
                    if message is None:
                        message = _message("msg_" + uuid.uuid4().hex, "", "in_progress")
                        output.append(message)
                        index = len(output) - 1
                        yield event(
                            "response.output_item.added",
                            output_index=index,
                            item=_message(message["id"], "", "in_progress"),
                        )
                        yield event(
                            "response.content_part.added",
                            item_id=message["id"],
                            output_index=index,
                            content_index=0,
                            part=_text_part(""),
                        )
                        message["content"] = [_text_part("")]
                    message["content"][0]["text"] += d.content
                    where = {
                        "item_id": message["id"],
                        "output_index": len(output) - 1,
                        "content_index": 0,
                    }
                    yield event("response.output_text.delta", **where, delta=d.content, logprobs=[])
                for tc in d.tool_calls:
                    for f in close_reasoning() + close_message():
                        yield f
                    call = ToolCall(tc.id or "", tc.name or "", tc.arguments)
                    calls.append(call)
                    item = _function_call(call)
                    output.append(item)
                    index = len(output) - 1
                    yield event(
                        "response.output_item.added",
                        output_index=index,
                        item=item | {"arguments": "", "status": "in_progress"},
                    )
                    yield event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=call.arguments,
                    )
                    yield event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        arguments=call.arguments,
                    )
                    yield event("response.output_item.done", output_index=index, item=item)
            for f in close_reasoning() + close_message():
                yield f
            if not output:  # an empty reply: one empty message
                item = _message("msg_" + uuid.uuid4().hex, "", "completed")
                output.append(item)
                yield event("response.output_item.added", output_index=0, item=item)
                yield event("response.output_item.done", output_index=0, item=item)
            body = finish(run.result, output, calls)
            yield event(f"response.{body['status']}", response=body)

        def on_error(e: APIError) -> str:
            body = {
                "type": "error",
                "code": e.code or e.type,
                "message": e.message,
                "param": e.param,
            }
            return f"event: error\ndata: {json.dumps(body)}\n\n"

        return SSEResponse(framed(events(), run, on_error), run.close)


def _reasoning(text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [], "content": content}


def _function_call(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + uuid.uuid4().hex,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_text_part(text)] if text or status == "completed" else []
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _response(
    resp_id: str,
    model: str,
    req: ResponsesRequest,
    status: str,
    output: list[dict[str, Any]],
    res: ChatResult | None,
) -> dict[str, Any]:
    usage = None
    if res is not None:
        usage = {
            "input_tokens": res.prompt_tokens,
            "input_tokens_details": {"cached_tokens": res.cached_tokens},
            "output_tokens": res.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": res.prompt_tokens + res.completion_tokens,
        }
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": resp_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "temperature": req.temperature,
        "text": {"format": _format_echo(req)},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def _format_echo(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)


def add_responses_routes(app, responses: ResponsesServing, limit: int) -> None:
    """Register POST /v1/responses and GET /v1/responses/{id} (OpenAI's error shape)."""
    from mlxserve.server.body import parse_body

    async def create(request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest, limit)
        return await responses.create(request, body)

    async def retrieve(response_id: str) -> dict:
        return responses.retrieve(response_id)

    sse = "text/event-stream"
    app.add_api_route(
        "/v1/responses",
        create,
        methods=["POST"],
        **doc.other_api_route(ResponsesRequest, doc.ErrorResponse, sse),
    )
    app.add_api_route(
        "/v1/responses/{response_id}",
        retrieve,
        methods=["GET"],
        **doc.other_api_route(None, doc.ErrorResponse),
    )
