"""One chat generation on the engine, for every API: ChatRequest in, ChatRun runs it.

Each API (OpenAI chat, Anthropic, Responses, Ollama) translates its body into a
ChatRequest: chat messages (or a raw prompt), OpenAI function tools and a tool_choice,
SamplingParams (constraints included) and the template's switches. ChatRun plans tools
and reasoning, renders the prompt, runs it as one engine request (n samples) through
the same AsyncLLM, RequestGroup, cancellation and in-flight tracking, and hands back the
outputs: raw (OpenAI's per-sample chunks and logprobs), as text deltas, or parsed into
content, reasoning and tool calls. The API then formats them its own way.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from mlxserve.core.request import RequestOutput
from mlxserve.exceptions import ParameterError
from mlxserve.parsers import OutputParser, ParsedDelta, ParsedMessage
from mlxserve.sampling_params import SamplingParams
from mlxserve.server import streams
from mlxserve.server.chat_tools import ChatPlan
from mlxserve.server.errors import APIError, bad_request
from mlxserve.server.formatting import PromptResult
from mlxserve.server.prompt_normalization import dropped_reasoning
from mlxserve.server.served_model import ServedModel
from mlxserve.server.serving import Serving
from mlxserve.server.streams import (
    ClientDisconnected,
    RequestGroup,
    SSEResponse,
    run_unless_disconnected,
)


@dataclass
class ChatRequest:
    """One chat generation, as each API's body translates into it."""

    params: SamplingParams  # sampling, n, logprobs, and constraints (structured_outputs)
    messages: list[dict[str, Any]] | None = None  # chat messages (the template's shape)
    prompt: str | None = None  # or a raw prompt, without the chat template
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools
    tool_choice: str | None = None  # "none" | "auto" | "required" | a function's name
    parallel_tool_calls: bool = True
    # The chat template's switches (enable_thinking, reasoning_effort...), which
    # templates that do not know them ignore.
    template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass
class ChatResult:
    """What one generation produced, with its token counts."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    start_time: float = field(default_factory=time.monotonic)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class ChatRun:
    """A ChatRequest as one engine request (``params.n`` samples).

    With tools the model's ChatFeatures plan the prompt and the constraint, and the reply
    is parsed into content, reasoning and tool calls the same way for every API.
    """

    def __init__(
        self, serving: Serving, model: ServedModel, prefix: str, prompt_param: str = "messages"
    ) -> None:
        self.serving = serving  # shutdown state, in-flight requests
        self.model = model  # the model that runs it (Serving.resolve's answer)
        self.request_id = f"{prefix}-{uuid.uuid4().hex}"
        self.prompt_param = prompt_param  # the request field a rejected prompt is blamed on
        self.result = ChatResult()
        self.group: RequestGroup | None = None
        self.parser: OutputParser | None = None
        self.plan: ChatPlan | None = None
        self.prompt = ""  # the rendered prompt, once started
        self.parallel_tool_calls = True
        # Engine parameter -> the request field that set it (for 400s).
        self.field_names: dict[str, str] = {}
        # An API's own mapping of engine rejections to 400s (None: blame field_names' field).
        self.engine_error: Callable[[ValueError], APIError] | None = None

    def prepare(self, chat: ChatRequest) -> tuple[str, list[int], ChatPlan]:
        """Plan tools and reasoning, then render (call in a worker thread): text, ids, plan."""
        assert chat.messages is not None
        try:
            plan = self.model.features.plan(
                chat.messages,
                chat.tools or [],
                chat.tool_choice,
                chat.parallel_tool_calls,
                chat.params,
            )
        except ParameterError as e:
            raise self._engine_error(e) from None
        tok = self.model.tokenizer
        try:
            text = tok.apply_chat_template(
                plan.messages,
                tools=plan.tools,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                **(chat.template_kwargs or {}),
            )
        except ValueError as e:
            param = getattr(e, "parameter", None) or self.prompt_param
            raise bad_request(str(e), param) from None
        self.model.features.note_dropped_reasoning(dropped_reasoning(plan.messages, text))
        return text, tok.encode_rendered_chat(text), plan

    async def start(self, raw: Request, chat: ChatRequest, stream: bool = False) -> None:
        """Render and submit; returns once the engine accepted it (APIError 400 if not):
        at its first output, or for a ``stream`` after streams.KEEPALIVE_S without one (its
        keepalives need the headers sent).

        Raises ClientDisconnected if the client left meanwhile.
        """
        self.serving.check_accepting()
        starts_after = None
        params = chat.params
        if chat.messages is not None:
            text, ids, plan = await run_in_threadpool(self.prepare, chat)
            self.plan = plan
            self.parser = plan.output_parser(text)
            self.parallel_tool_calls = chat.parallel_tool_calls
            starts_after = plan.grammar_starts_after(text, params)
        else:
            assert chat.prompt is not None
            text = chat.prompt
            ids = await run_in_threadpool(self.model.tokenizer.encode, chat.prompt)
        self.prompt = text
        self.result.prompt_tokens = len(ids)
        self.group = RequestGroup(
            self.model.llm,
            [(self.request_id, text, ids, params)],
            self.serving.in_flight,
            grammar_starts_after=starts_after,
        )
        try:
            wait_s = streams.KEEPALIVE_S if stream else None
            await run_unless_disconnected(raw, self.group.start(wait_s))
        except ValueError as e:
            await self.close()
            raise self._engine_error(e) from None

    def _engine_error(self, e: ValueError) -> APIError:
        if self.engine_error is not None:
            return self.engine_error(e)
        if isinstance(e, ParameterError) and e.parameter not in (None, "prompt"):
            param = e.parameter
            name = self.field_names.get(param) or self.field_names.get(param.split(".")[0], param)
            return bad_request(str(e), name)
        return bad_request(str(e), self.prompt_param)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The engine's delta outputs, every sample's, as they come."""
        assert self.group is not None
        async for _, out in self.group.outputs():
            yield out

    async def samples(self, raw: Request) -> PromptResult:
        """Every sample whole (ClientDisconnected if the client leaves first; an engine
        rejection meanwhile is a 400)."""

        async def work() -> PromptResult:
            result = PromptResult()
            async for out in self.outputs():
                result.add(out)
            return result

        try:
            return await run_unless_disconnected(raw, work())
        except ValueError as e:
            raise self._engine_error(e) from None
        finally:
            await self.close()

    def scheduled(self) -> bool:
        """Whether the engine has scheduled the request (its cached-token count is then
        in ``result``), before any output."""
        cached = self.model.llm.num_cached_tokens(self.request_id)
        if cached is not None:
            self.result.cached_tokens = cached
        return cached is not None

    async def deltas(self) -> AsyncIterator[str]:
        """The text as it is generated; ``result`` holds the totals once it ends."""
        assert self.group is not None
        res = self.result
        async for _, out in self.group.outputs():
            res.cached_tokens = out.num_cached_tokens
            c = out.outputs[0]
            res.token_ids += c.token_ids
            res.text += c.text
            if c.finish_reason is not None:
                res.finish_reason, res.stop_reason = c.finish_reason, c.stop_reason
            if out.error is not None:
                raise APIError(500, out.error)
            if c.text:
                yield c.text

    async def parsed_deltas(self, announce_start: bool = False) -> AsyncIterator[ParsedDelta]:
        """The reply as it is generated, parsed: content, reasoning, whole tool calls.

        ``announce_start``: also an empty delta once the engine's first output is in (the
        prompt's cached-token count is known from then on).
        """
        async for text in self.deltas():
            if announce_start:
                announce_start = False
                yield ParsedDelta()
            delta = self.parser.feed(text) if self.parser else ParsedDelta(content=text)
            if delta:
                yield self._limit(delta)
        if self.parser is not None:
            delta = self.parser.finish()
            if delta:
                yield self._limit(delta)

    def parsed(self) -> ParsedMessage:
        """The whole reply, parsed (after collect())."""
        text = self.result.text
        if self.parser is None:
            return ParsedMessage(text, "", [])
        message = self.parser.parse(text)
        if not self.parallel_tool_calls:
            message.tool_calls = message.tool_calls[:1]
        return message

    def _limit(self, delta: ParsedDelta) -> ParsedDelta:
        if not self.parallel_tool_calls:  # the first call only
            delta.tool_calls = [tc for tc in delta.tool_calls if tc.index == 0]
        return delta

    async def collect(self, raw: Request) -> ChatResult:
        """The whole generation (ClientDisconnected if the client leaves first)."""

        async def drain() -> None:
            async for _ in self.deltas():
                pass

        try:
            await run_unless_disconnected(raw, drain())
        finally:
            await self.close()
        return self.result

    async def close(self) -> None:
        """Abort whatever has not finished."""
        if self.group is not None:
            await self.group.close()


class NDJSONResponse(SSEResponse):
    """Newline-delimited JSON (Ollama's streams), closed the moment the client leaves."""

    media_type = "application/x-ndjson"


async def framed(
    events: AsyncIterator[str], run: ChatRun, on_error: Callable[[Exception], str]
) -> AsyncIterator[str]:
    """Frames of a stream; an error once the status line is sent is reported in-stream."""
    try:
        async with contextlib.aclosing(events):
            async for frame in events:
                yield frame
    except APIError as e:
        yield on_error(e)
    except Exception as e:  # noqa: BLE001 -- the status line is sent: report in-stream
        yield on_error(APIError(500, f"internal error: {e}"))
    finally:
        await run.close()


async def started(run: ChatRun, raw: Request, start: Awaitable[None]) -> bool:
    """Await ``start``; False if the client left meanwhile (answer 499 then)."""
    try:
        await start
    except ClientDisconnected:
        await run.close()
        return False
    return True
