"""One generation on the engine for the API translators (Ollama, Anthropic, Responses).

Each translator turns its body into chat messages (or a raw prompt) and SamplingParams;
this runs them through the same AsyncLLM, RequestGroup, cancellation and in-flight
tracking as /v1/chat/completions, and hands back the text as deltas or as a whole.
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

from mlxserve.exceptions import ParameterError
from mlxserve.sampling_params import SamplingParams
from mlxserve.server.errors import APIError, bad_request
from mlxserve.server.streams import (
    ClientDisconnected,
    RequestGroup,
    SSEResponse,
    run_unless_disconnected,
)


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
    """A chat conversation (or a raw prompt) as one engine request."""

    def __init__(self, serving, prefix: str, prompt_param: str = "messages") -> None:
        self.serving = serving
        self.request_id = f"{prefix}-{uuid.uuid4().hex}"
        self.prompt_param = prompt_param  # the request field a rejected prompt is blamed on
        self.result = ChatResult()
        self.group: RequestGroup | None = None

    def render(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> tuple[str, list]:
        """The chat template applied to ``messages`` (call in a worker thread): text, ids."""
        tok = self.serving.tokenizer
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        except ValueError as e:
            raise bad_request(str(e), self.prompt_param) from None
        return text, tok.encode_rendered_chat(text)

    async def start(
        self,
        raw: Request,
        params: SamplingParams,
        messages: list[dict[str, Any]] | None = None,
        prompt: str | None = None,
        **template_kwargs: Any,
    ) -> None:
        """Render and submit; returns once the engine accepted it (APIError 400 if not).

        Raises ClientDisconnected if the client left meanwhile.
        """
        self.serving.check_accepting()
        if messages is not None:
            text, ids = await run_in_threadpool(self.render, messages, **template_kwargs)
        else:
            assert prompt is not None
            text = prompt
            ids = await run_in_threadpool(self.serving.tokenizer.encode, prompt)
        self.result.prompt_tokens = len(ids)
        self.group = RequestGroup(
            self.serving.llm, [(self.request_id, text, ids, params)], self.serving.in_flight
        )
        try:
            await run_unless_disconnected(raw, self.group.start())
        except ValueError as e:
            await self.close()
            raise self._engine_error(e) from None

    def _engine_error(self, e: ValueError) -> APIError:
        if isinstance(e, ParameterError) and e.parameter not in (None, "prompt"):
            return bad_request(str(e), e.parameter)
        return bad_request(str(e), self.prompt_param)

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
