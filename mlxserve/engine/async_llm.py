"""AsyncLLM: one thread owns the engine; asyncio callers get async iterators of outputs.

    HTTP handler --(inbox: AddRequest / AbortRequest)--> engine thread: step() in a loop
    HTTP handler <--(per-request asyncio.Queue)-- outputs, one handoff per step and loop

A step's outputs reach each event loop in one ``call_soon_threadsafe`` (one wakeup of
that loop, one write to its self-pipe), not one per request: with 32 streams that is 1
wakeup per step instead of 32, and the engine thread hands off in one call.

Handlers never touch the model. A request whose step failed because of it gets a
RequestFailedError; the others go on (the engine isolates the culprit). Only an error
the engine cannot pin on requests fails every accepted request, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mlxserve.core.request import RequestOutput
from mlxserve.engine.cache_stats import CacheStats
from mlxserve.engine.llm_engine import LLMEngine
from mlxserve.engine.model_info import ModelInfo
from mlxserve.exceptions import RequestFailedError
from mlxserve.pooling_params import PoolingParams
from mlxserve.sampling_params import SamplingParams
from mlxserve.structured_output.grammar import StructuredOutputRequest
from mlxserve.worker.spmd import RankLostError

logger = logging.getLogger("mlxserve")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


# The engine thread's inbox: what handlers (any thread) ask of the engine.
@dataclass(frozen=True, slots=True)
class AddRequest:
    """Add one request (LLMEngine.add_request's arguments, its constraint compiled)."""

    request_id: str
    prompt: str | list[int] | None
    params: SamplingParams
    prompt_token_ids: list[int] | None
    arrival_time: float
    structured_output: StructuredOutputRequest | None
    pooling_params: PoolingParams | None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Abort one request (its blocks are freed on the engine thread)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ForgetPrefixes:
    """Forget the prefix cache once no request runs; ``done`` gets the blocks forgotten."""

    done: concurrent.futures.Future[int]


@dataclass(frozen=True, slots=True)
class Wake:
    """Nothing to do: wakes the engine thread so that it sees a shutdown."""


InboxItem = AddRequest | AbortRequest | ForgetPrefixes | Wake


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Hand one item to the stream's loop now (outside steps: errors, failures)."""
        _Handoff().add(self, item).send()


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for q, item in items:  # on the event loop: wake each waiting consumer
        q.put_nowait(item)


class _Handoff:
    """Items for streams, gathered per event loop; send() wakes each loop once."""

    def __init__(self) -> None:
        self.by_loop: dict[asyncio.AbstractEventLoop, list] = {}

    def add(self, stream: _Stream, item: RequestOutput | BaseException) -> _Handoff:
        self.by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        return self

    def send(self) -> int:
        """Schedule every item on its loop; the number of loops woken."""
        for loop, items in self.by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                pass
        return len(self.by_loop)


class AsyncLLM:
    """Thread-owned LLMEngine with an async generate() per request."""

    def __init__(self, engine: LLMEngine, on_step=None, on_dead=None) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[InboxItem] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        # Requests the engine accepted and that have not finished (engine thread only).
        self._accepted: set[str] = set()
        self._on_step = on_step  # called in the engine thread after each step (metrics)
        # Called in the engine thread with the reason when the engine cannot go on (a
        # tensor-parallel rank is gone); the server then exits. ``dead_reason`` keeps it.
        self._on_dead = on_dead
        self.dead_reason: str | None = None
        # forget_cached_prefixes() calls waiting for the engine to be idle (engine thread).
        self._forget_when_idle: list[concurrent.futures.Future[int]] = []
        self._stop = threading.Event()
        # Engine steps taken, and event-loop wakeups that handed their outputs over.
        self.num_steps = 0
        self.num_handoffs = 0
        if engine.ranks is not None:  # a broken group the engine cannot report ends the process
            engine.ranks.before_exit = self._fail_streams
        self._thread = threading.Thread(target=self._run, name="mlxserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def describe(self) -> ModelInfo:
        """The served model (its limits, size, facts and tokenizer): LLMEngine.describe()."""
        return self.engine.describe()

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        pooling_params: PoolingParams | None = None,
        grammar_starts_after: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Delta outputs of one request; closing the iterator early aborts the request.

        A structured-outputs constraint is compiled here, in a worker thread, so that a
        large schema never stalls the engine thread (nor other requests' steps); an
        invalid one raises ParameterError before anything is queued. With
        ``grammar_starts_after`` (e.g. "</think>") it applies after that text only.
        With ``pooling_params`` it is an embedding request (see LLMEngine.add_request).
        """
        if not self.is_running:
            raise EngineDeadError("the engine thread is not running")
        arrival = time.monotonic()
        structured = None
        if params is not None and params.structured_outputs is not None:
            structured = await asyncio.to_thread(
                self.engine.compile_structured_output, params, grammar_starts_after
            )
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._inbox.put(
            AddRequest(
                request_id,
                prompt,
                params,
                prompt_token_ids,
                arrival,
                structured,
                pooling_params,
            )
        )
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # client went away, or the consumer stopped early
                self.abort(request_id)

    def num_cached_tokens(self, request_id: str) -> int | None:
        """From any thread: the request's prompt tokens held by the prefix cache, once it
        was first scheduled (before its first output: a long prefill), else None."""
        return self.engine.num_cached_tokens(request_id)

    def cache_stats(self) -> CacheStats:
        """From any thread: the prefix cache's blocks and counters (LLMEngine.cache_stats)."""
        return self.engine.cache_stats()

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed on the engine thread."""
        self._inbox.put(AbortRequest(request_id))

    def forget_cached_prefixes(self) -> concurrent.futures.Future[int]:
        """From any thread: forget the prefix cache the next time no request runs (their
        prefixes are in use until then). The future holds the number of blocks forgotten."""
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._inbox.put(ForgetPrefixes(done))
        return done

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(Wake())
        self._thread.join(timeout=30)

    # ------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self.engine.shutdown()  # the other tensor-parallel ranks, from this thread
            self.engine.runner.release_thread()

    def _serve(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished_requests()
            self._drain(block=not busy)
            if self._stop.is_set():
                break
            if self._forget_when_idle and not self.engine.has_unfinished_requests():
                num_forgotten = self.engine.reset_prefix_cache()
                for done in self._forget_when_idle:
                    done.set_result(num_forgotten)
                self._forget_when_idle.clear()
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step(delta=True)
            except RankLostError as e:  # the engine is dead: fail everything, stop
                logger.error("%s", e)
                self.dead_reason = str(e)
                self._fail_all(e)
                if self._on_dead is not None:
                    self._on_dead(self.dead_reason)
                return
            except Exception as e:  # noqa: BLE001 -- keep serving; fail only this step's requests
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            self.num_steps += 1
            handoff = _Handoff()
            for out in outputs:
                if out.finished:
                    self._accepted.discard(out.request_id)
                stream = self._streams.get(out.request_id)
                if stream is not None and out.error is not None:
                    handoff.add(stream, RequestFailedError(out.error, out.request_id))
                elif stream is not None:
                    handoff.add(stream, out)
            self.num_handoffs += handoff.send()
            if self._on_step is not None:
                self._on_step(self.engine, outputs)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: InboxItem) -> None:
        if isinstance(item, AddRequest):
            try:
                self.engine.add_request(
                    item.request_id,
                    item.prompt,
                    item.params,
                    prompt_token_ids=item.prompt_token_ids,
                    arrival_time=item.arrival_time,
                    structured_output=item.structured_output,
                    pooling_params=item.pooling_params,
                )
            except Exception as e:  # noqa: BLE001 -- bad requests go back to their caller
                stream = self._streams.get(item.request_id)
                if stream is not None:
                    stream.put(e)
            else:
                self._accepted.add(item.request_id)
        elif isinstance(item, ForgetPrefixes):
            self._forget_when_idle.append(item.done)
        elif isinstance(item, AbortRequest):
            self._accepted.discard(item.request_id)
            for out in self.engine.abort_request(item.request_id):
                if self._on_step is not None:
                    self._on_step(self.engine, [out])

    def _fail_streams(self, reason: str) -> None:
        """Fail every caller still waiting, without the engine (its thread may be blocked
        for good in a collective): the rank watchdog's last act before it ends the process."""
        failure = RuntimeError(f"internal error while running the model: {reason}")
        handoff = _Handoff()
        for stream in list(self._streams.values()):
            handoff.add(stream, failure)
        handoff.send()

    def _fail_all(self, error: Exception) -> None:
        # Every accepted request fails, including those the failing step already
        # aborted itself (they are gone from engine.outputs but their callers still wait).
        finals = self.engine.abort_request(list(self.engine.outputs.states))
        failure = RuntimeError(f"internal error while running the model: {error}")
        handoff = _Handoff()
        for rid in self._accepted:
            stream = self._streams.get(rid)
            if stream is not None:
                handoff.add(stream, failure)
        handoff.send()
        self._accepted.clear()
        if self._on_step is not None and finals:
            self._on_step(self.engine, finals)
