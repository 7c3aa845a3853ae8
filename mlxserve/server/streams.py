"""The engine requests of one API call, and cancelling them when the client goes away.

An API call with several prompts (or one) becomes one engine request per prompt; a
RequestGroup runs them together and merges their delta outputs. Whatever ends a call
early -- a client disconnect, an error, a closed stream -- closes the group, which
aborts every unfinished request in the engine (AsyncLLM.generate aborts on close).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from mlxserve.core.request import RequestOutput
from mlxserve.engine.async_llm import AsyncLLM
from mlxserve.pooling_params import PoolingParams
from mlxserve.sampling_params import SamplingParams

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


class InFlight:
    """The API calls being served, and whether the server still takes new ones.

    A graceful shutdown first stops taking calls (``start_draining``), then, when its
    timeout is up, fails the calls still running (``fail_all``).
    """

    def __init__(self) -> None:
        self.groups: set[RequestGroup] = set()
        self.is_draining = False

    def __len__(self) -> int:
        return len(self.groups)

    def start_draining(self) -> None:
        """Refuse new calls from now on."""
        self.is_draining = True

    def fail_all(self, error: BaseException) -> int:
        """End every call in flight with ``error``; how many there were."""
        groups = list(self.groups)
        for group in groups:
            group.fail(error)
        return len(groups)


class RequestGroup:
    """Engine requests started together; outputs merged as (prompt index, delta output)."""

    def __init__(
        self,
        llm: AsyncLLM,
        requests: list[tuple[str, str | None, list[int], SamplingParams | None]],
        in_flight: InFlight | None = None,
        pooling_params: PoolingParams | None = None,  # embedding requests, all of them
        grammar_starts_after: str | None = None,
    ) -> None:
        extra = {} if pooling_params is None else {"pooling_params": pooling_params}
        self._gens = [
            llm.generate(
                rid,
                prompt,
                params,
                prompt_token_ids=ids,
                grammar_starts_after=grammar_starts_after,
                **extra,
            )
            for rid, prompt, ids, params in requests
        ]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._buffer: list[tuple[int, RequestOutput]] = []
        self._in_flight = in_flight
        if in_flight is not None:
            in_flight.groups.add(self)

    async def _pump(self, index: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                self._queue.put_nowait((index, out, None))
        except Exception as e:  # noqa: BLE001 -- handed to the consumer
            self._queue.put_nowait((index, None, e))

    async def start(self, wait_s: float | None = None) -> None:
        """Submit every request; return once each has produced its first output, or after
        ``wait_s`` seconds without (a long prefill: a stream's headers go out then, and
        outputs() brings the rest, errors included).

        Raises the engine's error (e.g. ValueError: prompt too long) if one is rejected
        (at once, on submission); the others are aborted then.
        """
        self._tasks = [asyncio.create_task(self._pump(i, g)) for i, g in enumerate(self._gens)]
        started: set[int] = set()
        loop = asyncio.get_running_loop()
        deadline = None if wait_s is None else loop.time() + wait_s
        try:
            while len(started) < len(self._gens):
                try:
                    timeout = None if deadline is None else max(0.0, deadline - loop.time())
                    index, out, error = await asyncio.wait_for(self._queue.get(), timeout)
                except asyncio.TimeoutError:
                    return
                if error is not None:
                    raise error
                started.add(index)
                self._buffer.append((index, out))
        except BaseException:
            await self.close()
            raise

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Delta outputs of all requests, in arrival order, until every one has finished."""
        num_left = len(self._gens)
        for index, out in self._buffer:
            num_left -= out.finished
            yield index, out
        self._buffer.clear()
        while num_left:
            index, out, error = await self._queue.get()
            if error is not None:
                raise error
            num_left -= out.finished
            yield index, out

    def fail(self, error: BaseException) -> None:
        """Make the consumer raise ``error`` now (start() or outputs(), whichever waits)."""
        self._queue.put_nowait((-1, None, error))

    async def close(self) -> None:
        """Abort whatever has not finished (no-op once all have)."""
        if self._in_flight is not None:
            self._in_flight.groups.discard(self)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for gen in self._gens:
            with contextlib.suppress(RuntimeError):
                await gen.aclose()


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects (ClientDisconnected)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientDisconnected()
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


# A comment line (every SSE parser skips it) sent when a stream has been silent this long:
# a long prompt's prefill can keep the first event back for minutes on a CPU, and proxies
# drop a connection that stays idle. A client that times out between events (Codex: 300 s)
# needs an event of its API instead: the Responses stream repeats response.in_progress.
KEEPALIVE_S = 15.0
KEEPALIVE = ": keepalive\n\n"


TICK = object()  # what ticking() yields after a silence
_END = object()


async def ticking(items: AsyncIterator[T], every: float) -> AsyncIterator[T | object]:
    """``items``, with TICK after each ``every`` seconds without one. One task pumps them
    into a buffer, so an item costs a future and a timer, not a task of its own (a token's
    frame goes through here); closing this cancels the pump, which closes ``items``."""
    loop = asyncio.get_running_loop()
    ready: collections.deque[tuple[Any, BaseException | None]] = collections.deque()
    wake: asyncio.Future[None] | None = None

    def put(item: Any, error: BaseException | None = None) -> None:
        ready.append((item, error))
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def pump() -> None:
        try:
            async for item in items:
                put(item)
        except Exception as e:  # noqa: BLE001 -- raised to the consumer, in order
            put(_END, e)
        else:
            put(_END)

    task = loop.create_task(pump())
    try:
        while True:
            if not ready:
                wake = loop.create_future()
                timer = loop.call_later(every, lambda w=wake: w.done() or w.set_result(None))
                try:
                    await wake
                finally:
                    timer.cancel()
                if not ready:
                    yield TICK
                    continue
            item, error = ready.popleft()
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        if not task.done():  # the client left mid-stream: stop the items' step first
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()


async def with_keepalive(frames: AsyncIterator[str], every: float) -> AsyncIterator[str]:
    """``frames``, with a KEEPALIVE comment after each ``every`` seconds without one."""
    ticks = ticking(frames, every)
    try:
        async for frame in ticks:
            yield KEEPALIVE if frame is TICK else frame
    finally:
        await ticks.aclose()


class SSEResponse(StreamingResponse):
    """A text/event-stream that stops, and closes its iterator, the moment the client leaves.

    Starlette only watches for the disconnect on older ASGI specs and never closes the
    iterator; closing it is what aborts the engine requests behind the stream. A stream
    silent for ``keepalive_s`` gets a comment line, so idle timeouts do not cut it.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[str],
        on_close: Callable[[], Awaitable[None]] | None = None,
        keepalive_s: float | None = None,
    ) -> None:
        every = KEEPALIVE_S if keepalive_s is None else keepalive_s
        super().__init__(
            with_keepalive(content, every),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(RuntimeError):
                    await aclose()
            if self.on_close is not None:  # also when the iterator never started
                await self.on_close()
