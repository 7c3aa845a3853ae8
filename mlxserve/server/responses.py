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

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxserve.exceptions import ParameterError
from mlxserve.sampling_params import INT32_MAX, SamplingParams
from mlxserve.server.chat_run import ChatResult, ChatRun, framed, started
from mlxserve.server.errors import APIError, bad_request
from mlxserve.server.protocol import _Strict
from mlxserve.server.streams import ClientDisconnected, SSEResponse

# Responses kept for previous_response_id / GET: each holds its conversation's text.
MAX_STORED_RESPONSES = 1000
TEXT_PARTS = ("input_text", "output_text", "text")


class TextFormat(_Strict):
    type: Literal["text"]


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

    def check_unimplemented(self) -> None:
        if self.tools:
            raise bad_request("tools are not supported yet", "tools")
        if self.tool_choice not in (None, "auto", "none"):
            raise bad_request("tool_choice needs tools, which are not supported yet", "tool_choice")

    def sampling_params(self) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_output_tokens
            )
        except ParameterError as e:
            name = {"max_tokens": "max_output_tokens"}.get(e.parameter or "", e.parameter)
            raise bad_request(str(e), name) from None

    def input_messages(self) -> list[dict[str, str]]:
        """``input`` as chat messages; an item kind mlxserve cannot take yet is a 400."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            role = item.get("role")
            if kind != "message" or role not in ("user", "assistant", "system", "developer"):
                raise bad_request(
                    f"input[{i}]: items of type {kind!r} are not supported yet", "input"
                )
            content = item.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
                        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                        raise bad_request(
                            f"input[{i}]: content of type {kind!r} is not supported", "input"
                        )
                    texts.append(str(part.get("text", "")))
                content = "".join(texts)
            if not isinstance(content, str):
                raise bad_request(f"input[{i}].content must be a string or text parts", "input")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        if not out:
            raise bad_request("input must not be empty", "input")
        return out


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
        req.check_unimplemented()
        params = req.sampling_params()
        history: list[dict[str, str]] = []
        if req.previous_response_id is not None:
            _, history = self.store.get(req.previous_response_id)
        conversation = history + req.input_messages()
        messages = conversation
        if req.instructions:
            messages = [{"role": "system", "content": req.instructions}] + conversation
        run = ChatRun(self.serving, "resp", "input")
        if not await started(run, raw, run.start(raw, params, messages=messages)):
            return Response(status_code=499)
        resp_id, item_id = "resp_" + uuid.uuid4().hex, "msg_" + uuid.uuid4().hex
        base = _response(resp_id, model, req, "in_progress", [], None)

        def finish(res: ChatResult) -> dict:
            status = "incomplete" if res.finish_reason == "length" else "completed"
            out = [_message(item_id, res.text, "completed")]
            body = _response(resp_id, model, req, status, out, res)
            if req.store:
                assistant = {"role": "assistant", "content": res.text}
                self.store.put(body, conversation + [assistant])
            return body

        if not req.stream:
            try:
                res = await run.collect(raw)
            except ClientDisconnected:
                return Response(status_code=499)
            return JSONResponse(finish(res))

        async def events():
            seq = iter(range(1 << 62))

            def event(kind: str, **data: Any) -> str:
                payload = {"type": kind, "sequence_number": next(seq)} | data
                return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

            where = {"item_id": item_id, "output_index": 0, "content_index": 0}
            yield event("response.created", response=base)
            yield event("response.in_progress", response=base)
            yield event(
                "response.output_item.added",
                output_index=0,
                item=_message(item_id, "", "in_progress"),
            )
            yield event("response.content_part.added", **where, part=_text_part(""))
            async for text in run.deltas():
                yield event("response.output_text.delta", **where, delta=text, logprobs=[])
            res = run.result
            yield event("response.output_text.done", **where, text=res.text, logprobs=[])
            yield event("response.content_part.done", **where, part=_text_part(res.text))
            yield event(
                "response.output_item.done",
                output_index=0,
                item=_message(item_id, res.text, "completed"),
            )
            body = finish(res)
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
        "text": {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": [],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def add_responses_routes(app, responses: ResponsesServing, limit: int) -> None:
    """Register POST /v1/responses and GET /v1/responses/{id} (OpenAI's error shape)."""
    from mlxserve.server.body import parse_body

    async def create(request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest, limit)
        return await responses.create(request, body)

    async def retrieve(response_id: str) -> dict:
        return responses.retrieve(response_id)

    app.add_api_route("/v1/responses", create, methods=["POST"], include_in_schema=False)
    app.add_api_route(
        "/v1/responses/{response_id}", retrieve, methods=["GET"], include_in_schema=False
    )
