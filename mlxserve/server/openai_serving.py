"""OpenAI's /v1/completions and /v1/chat/completions: request -> engine -> OpenAI response.

Completions run their prompts as a RequestGroup; chat completions translate into a
ChatRequest and run through ChatRun (server/chat_run.py), as Anthropic, Responses and
Ollama do, then format its samples in OpenAI's shape. Handlers tokenize (in a worker
thread), then only enqueue and await: AsyncLLM's thread runs the engine. Each call first
waits until every engine request has its first output, so a prompt the engine rejects
(too long, ...) is still a 400 even when streaming.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxserve.core.request import RequestOutput
from mlxserve.exceptions import ParameterError
from mlxserve.sampling_params import SamplingParams
from mlxserve.server import streams
from mlxserve.server.chat_run import ChatRequest, ChatRun, started
from mlxserve.server.chat_tools import ReplyFormatter
from mlxserve.server.errors import APIError, bad_request, error_body
from mlxserve.server.formatting import (
    CompletionLogprobs,
    PromptResult,
    chat_logprobs,
    usage,
)
from mlxserve.server.protocol import ChatCompletionRequest, CompletionRequest, request_error
from mlxserve.server.served_model import ServedModel
from mlxserve.server.serving import Serving
from mlxserve.server.streams import (
    ClientDisconnected,
    RequestGroup,
    SSEResponse,
    run_unless_disconnected,
    sse,
)

logger = logging.getLogger("mlxserve.server")

_Request = CompletionRequest | ChatCompletionRequest

# Keys of chat_template_kwargs that would clash with the template's own arguments.
RESERVED_TEMPLATE_KWARGS = {"messages", "add_generation_prompt", "tools", "continue_final_message"}


class OpenAIServing:
    """The OpenAI generation endpoints over the server's models (Serving)."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    # ------------------------------------------------------------- running
    async def _run(
        self, raw: Request, group: RequestGroup, req: _Request, prompt_param: str
    ) -> None:
        """Start a stream's group; engine rejections become 400s. After KEEPALIVE_S without
        a first output (a long prefill) the headers go out, keepalives follow."""
        try:
            await run_unless_disconnected(raw, group.start(streams.KEEPALIVE_S))
        except ValueError as e:
            raise _engine_error(e, req, prompt_param) from None

    async def _collect(
        self,
        raw: Request,
        group: RequestGroup,
        num_prompts: int,
        req: _Request,
        prompt_param: str,
    ) -> list[PromptResult]:
        async def work() -> list[PromptResult]:
            await group.start()
            results = [PromptResult() for _ in range(num_prompts)]
            async for i, out in group.outputs():
                results[i].add(out)
            return results

        try:
            return await run_unless_disconnected(raw, work())
        except ValueError as e:
            raise _engine_error(e, req, prompt_param) from None
        finally:
            await group.close()

    # ------------------------------------------------------------ completions
    def _encode_prompts(
        self, model: ServedModel, prompts: list[str | list[int]], add_special_tokens: bool
    ) -> list[tuple[str | None, list[int]]]:
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append((p, model.tokenizer.encode(p, add_special_tokens=add_special_tokens)))
            else:  # the engine checks the ids (and every other prompt rule)
                out.append((None, list(p)))
        return out

    async def create_completion(self, raw: Request, req: CompletionRequest) -> Response:
        """POST /v1/completions: JSON, or an event stream when req.stream."""
        self.serving.check_accepting()
        model = await self.serving.resolve(req.model)
        params = req.sampling_params(model.sampling_defaults)
        req.log_ignored()
        prompts = await run_in_threadpool(
            self._encode_prompts, model, req.prompts(), req.add_special_tokens
        )
        # The texts echo puts first, decoded off the event loop for prompts given as ids.
        echoed = (
            await run_in_threadpool(lambda: [_prompt_text(model, p) for p in prompts])
            if (req.echo)
            else [""] * len(prompts)
        )
        rid = f"cmpl-{uuid.uuid4().hex}"
        requests = [(f"{rid}-{i}", text, ids, params) for i, (text, ids) in enumerate(prompts)]
        group = RequestGroup(model.llm, requests, self.serving.in_flight)
        head = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model.name,
        }
        if req.stream:
            try:
                await self._run(raw, group, req, "prompt")
            except ClientDisconnected:
                return Response(status_code=499)
            chunks = self._completion_chunks(model, group, req, params, head, echoed)
            return SSEResponse(_event_stream(chunks, group.close, "completion"), group.close)
        try:
            results = await self._collect(raw, group, len(prompts), req, "prompt")
        except ClientDisconnected:
            return Response(status_code=499)
        choices = []
        for i, res in enumerate(results):
            prompt_text = echoed[i]
            for j in sorted(res.samples):
                s = res.samples[j]
                text = "".join(s.text)
                logprobs = None
                if req.logprobs is not None:
                    fmt = CompletionLogprobs(model.token_text)
                    ids, lps = s.token_ids, s.logprobs
                    if req.echo:
                        plp = res.prompt_logprobs or [None] * len(res.prompt_token_ids)
                        ids, lps = res.prompt_token_ids + ids, list(plp) + lps
                    logprobs = fmt.make(ids, lps)
                choices.append(
                    {
                        "index": i * params.n + j,
                        "text": prompt_text + text if req.echo else text,
                        "logprobs": logprobs,
                        "finish_reason": s.finish_reason,
                        "stop_reason": s.stop_reason,
                    }
                )
        return JSONResponse(head | {"choices": choices, "usage": _total_usage(results)})

    async def _completion_chunks(
        self,
        model: ServedModel,
        group: RequestGroup,
        req: CompletionRequest,
        params: SamplingParams,
        head: dict[str, Any],
        echoed: list[str],
    ) -> AsyncIterator[dict]:
        n = params.n
        fmts: dict[int, CompletionLogprobs] = {}
        finished: set[int] = set()
        totals = _StreamTotals(len(echoed))
        extra = {"usage": None} if req.include_usage else {}
        async for i, out in group.outputs():
            totals.add(i, out)
            for c in out.outputs:
                index = i * n + c.index
                if index in finished:
                    continue
                first = index not in fmts
                if first:
                    fmts[index] = CompletionLogprobs(model.token_text)
                text, ids, lps = c.text, c.token_ids, c.logprobs or []
                if req.echo and first:
                    text = echoed[i] + text
                    plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                    ids, lps = out.prompt_token_ids + ids, list(plp) + lps
                show_logprobs = bool(ids) and req.logprobs is not None
                if not text and c.finish_reason is None and not show_logprobs:
                    continue  # tokens whose text is held back (partial UTF-8, stop prefix)
                if c.finish_reason is not None:
                    finished.add(index)
                logprobs = fmts[index].make(ids, lps) if req.logprobs is not None else None
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                yield head | {"choices": [choice]} | extra
        if req.include_usage:
            yield head | {"choices": [], "usage": totals.usage()}

    # ------------------------------------------------------------------- chat
    def chat_request(self, req: ChatCompletionRequest, params: SamplingParams) -> ChatRequest:
        """The body as the pipeline's ChatRequest (400 for template kwargs that clash)."""
        kwargs = req.template_kwargs()
        clash = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if clash:
            raise bad_request(
                f"chat_template_kwargs must not set {', '.join(clash)}", "chat_template_kwargs"
            )
        return ChatRequest(
            params,
            messages=req.template_messages(),
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            tool_choice=req.tool_choice_name(),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            template_kwargs=kwargs,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )

    async def create_chat_completion(self, raw: Request, req: ChatCompletionRequest) -> Response:
        """POST /v1/chat/completions: JSON, or an event stream when req.stream."""
        self.serving.check_accepting()
        model = await self.serving.resolve(req.model)
        params = req.sampling_params(model.sampling_defaults)
        req.log_ignored(() if req.tools else ("parallel_tool_calls",))
        chat = self.chat_request(req, params)
        run = ChatRun(self.serving, model, "chatcmpl")
        run.engine_error = lambda e: _engine_error(e, req, "messages")
        if not await started(run, raw, run.start(raw, chat, stream=bool(req.stream))):
            return Response(status_code=499)
        created = int(time.time())
        if req.stream:
            head = {"id": run.request_id, "object": "chat.completion.chunk", "created": created}
            chunks = self._chat_chunks(model, run, req, params, head | {"model": model.name})
            return SSEResponse(_event_stream(chunks, run.close, "chat"), run.close)
        try:
            res = await run.samples(raw)
        except ClientDisconnected:
            return Response(status_code=499)
        choices = []
        for j in sorted(res.samples):
            s = res.samples[j]
            reply = ReplyFormatter(run.plan, run.prompt)
            message = reply.message("".join(s.text))
            logprobs = None
            if req.logprobs:
                logprobs = {
                    "content": chat_logprobs(
                        s.token_ids, s.logprobs, params.num_logprobs, model.token_text
                    ),
                    "refusal": None,
                }
            choices.append(
                {
                    "index": j,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": reply.finish_reason(s.finish_reason),
                    "stop_reason": s.stop_reason,
                }
            )
        body = {"id": run.request_id, "object": "chat.completion", "created": created}
        body["model"] = model.name
        return JSONResponse(body | {"choices": choices, "usage": _total_usage([res])})

    async def _chat_chunks(
        self,
        model: ServedModel,
        run: ChatRun,
        req: ChatCompletionRequest,
        params: SamplingParams,
        head: dict[str, Any],
    ) -> AsyncIterator[dict]:
        extra = {"usage": None} if req.include_usage else {}
        totals = _StreamTotals(1)
        finished: set[int] = set()
        replies = [ReplyFormatter(run.plan, run.prompt) for _ in range(params.n)]
        for j in range(params.n):
            role = {"role": "assistant", "content": ""}
            choice = {"index": j, "delta": role, "logprobs": None, "finish_reason": None}
            yield head | {"choices": [choice]} | extra
        async for out in run.outputs():
            totals.add(0, out)
            for c in out.outputs:
                if c.index in finished:
                    continue
                reply = replies[c.index]
                deltas = reply.delta(c.text, final=c.finish_reason is not None)
                logprobs = None
                if req.logprobs and c.token_ids:
                    content = chat_logprobs(
                        c.token_ids, c.logprobs or [], params.num_logprobs, model.token_text
                    )
                    logprobs = {"content": content, "refusal": None}
                if c.finish_reason is None and not deltas and logprobs is None:
                    continue  # text held back (a marker may be starting, partial UTF-8)
                deltas = deltas or [{}]
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    choice = {
                        "index": c.index,
                        "delta": delta,
                        "logprobs": logprobs if k == 0 else None,
                        "finish_reason": reply.finish_reason(c.finish_reason) if last else None,
                        "stop_reason": c.stop_reason if last else None,
                    }
                    yield head | {"choices": [choice]} | extra
                if c.finish_reason is not None:
                    finished.add(c.index)
        if req.include_usage:
            yield head | {"choices": [], "usage": totals.usage()}


async def _event_stream(
    chunks: AsyncIterator[dict], close: Callable[[], Awaitable[None]], what: str
) -> AsyncIterator[str]:
    """Chunks as server-sent events, an in-stream error if producing them fails, [DONE] last."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield sse(chunk)
    except APIError as e:  # e.g. aborted by a shutdown: the client learns why
        yield sse(e.body())
    except Exception as e:  # noqa: BLE001 -- the status line is sent: report in-stream
        logger.exception("%s stream failed", what)
        yield sse(error_body(f"internal error: {e}", "internal_error"))
    finally:
        await close()
    yield sse("[DONE]")


class _StreamTotals:
    """Token counts of a stream, for its usage chunk."""

    def __init__(self, num_prompts: int) -> None:
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens = [0] * num_prompts
        self.completion_tokens = 0

    def add(self, index: int, out: RequestOutput) -> None:
        self.prompt_tokens[index] = len(out.prompt_token_ids)
        self.cached_tokens[index] = out.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def usage(self) -> dict:
        return usage(sum(self.prompt_tokens), self.completion_tokens, sum(self.cached_tokens))


def _total_usage(results: list[PromptResult]) -> dict:
    return usage(
        sum(len(r.prompt_token_ids) for r in results),
        sum(r.num_completion_tokens for r in results),
        sum(r.num_cached_tokens for r in results),
    )


def _engine_error(e: ValueError, req: _Request, prompt_param: str) -> APIError:
    """An engine rejection as a 400 naming the request field (None when the engine named none)."""
    if isinstance(e, ParameterError) and e.parameter is not None:
        if e.parameter == "prompt":
            return bad_request(str(e), prompt_param)
        return request_error(e, req.field_names())
    return bad_request(str(e), None)


def _prompt_text(model: ServedModel, prompt: tuple[str | None, list[int]]) -> str:
    text, ids = prompt
    return text if text is not None else model.tokenizer.decode(ids, skip_special_tokens=False)
