"""Which model serves a request: Serving, the server's models (server/served_model.py's
ServedModel and ModelSpec: one model loaded, one model servable).

Every API resolves the request's ``model`` field here, with ``await Serving.resolve``, and
then reads only the ServedModel it got back (its engine, tokenizer, limits, chat features
and sampling defaults).

A server knows the models it can serve (ModelSpec: names and what to load) and those it
has loaded (ServedModel, each its own AsyncLLM: engine thread, scheduler, KV pool). A
request for a model that is not loaded loads it, in a worker thread, once: racing
requests wait for the same load. Each HTTP request holds a lease on the models it
resolved until its response is sent, so a model is never unloaded under a request.
A model unloads ``keep_alive`` seconds after its last request (the server's default, or
the last request's Ollama ``keep_alive``; 0: at once), unless pinned; when a load would
pass ``max_loaded_models``, the least recently used idle model is unloaded first.

A server started with one model and no keep-alive keeps it for its life (ModelPolicy's
``unloads`` False), as a one-model server always did.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from mlxserve.server.errors import APIError
from mlxserve.server.keep_alive import describe_keep_alive
from mlxserve.server.served_model import ModelSpec, ServedModel
from mlxserve.server.streams import InFlight

logger = logging.getLogger("mlxserve")


@dataclass(frozen=True)
class ModelPolicy:
    """When loaded models unload."""

    # Whether models unload at all (False: a one-model server keeps its model for its life).
    unloads: bool = False
    keep_alive: float | None = 300.0  # seconds idle before unloading; None: never
    pinned: frozenset[str] = frozenset()  # names of models that never unload
    max_loaded_models: int = 3

    def __post_init__(self) -> None:
        if self.max_loaded_models < 1:
            raise ValueError(f"max_loaded_models must be >= 1, got {self.max_loaded_models}")


# What Serving calls (in a worker thread) to load a model: the spec in, a running model out.
Loader = Callable[[ModelSpec], ServedModel]
# A spec for a model added while serving (a pull): (served name, what to load, its name in
# the Hugging Face cache) -> how to serve it, as the server's flags say.
SpecMaker = Callable[[str, str, str | None], ModelSpec]

# The leases of the HTTP request being handled (set by ModelLeases, one list per request).
_LEASES: contextvars.ContextVar[list[_Lease] | None] = contextvars.ContextVar(
    "mlxserve_model_leases", default=None
)
FOREVER_ISO = "2999-01-01T00:00:00Z"  # Ollama's expires_at of a model that never unloads
# How long a load waits for a loaded model to become idle (unloadable) when every one is in
# use, loading or pinned; then the request is a 503.
ROOM_WAIT_S = 60.0


class _Slot:
    """One servable model: its spec, its ServedModel while loaded, who uses it."""

    def __init__(self, spec: ModelSpec, keep_alive: float | None) -> None:
        self.spec = spec
        self.model: ServedModel | None = None
        self.lock = asyncio.Lock()  # one load (or unload) at a time
        self.num_users = 0  # requests holding a lease
        self.last_used = time.monotonic()
        self.keep_alive = keep_alive  # after the last request: seconds, None for ever
        self.expires_at: float | None = None  # monotonic; None while used or kept for ever
        self.num_loads = 0

    @property
    def name(self) -> str:
        return self.spec.names[0]


@dataclass
class _Lease:
    """A request's use of a model, from its resolve until its response is sent."""

    slot: _Slot


class Serving:
    """The server's models (servable and loaded) and the requests in flight on them."""

    def __init__(
        self,
        models: list[ServedModel],
        specs: list[ModelSpec] | None = None,
        loader: Loader | None = None,
        policy: ModelPolicy | None = None,
        make_spec: SpecMaker | None = None,
    ) -> None:
        """``models``: those loaded at start-up, the first ``len(models)`` of ``specs``
        (default: one spec per model, nothing else to load). ``make_spec``: models can be
        added while serving (Ollama's pull), served as it says."""
        assert models, "a server starts with at least one model loaded"
        self.policy = policy or ModelPolicy()
        self.loader = loader
        self.make_spec = make_spec
        specs = specs or [ModelSpec(m.names, root=m.root) for m in models]
        self._slots: list[_Slot] = []
        self._by_name: dict[str, _Slot] = {}
        for spec in specs:
            self.add(spec)
        for slot, model in zip(self._slots, models, strict=False):
            slot.model = model
            slot.num_loads = 1
            self._touch(slot)
        self.in_flight = InFlight()
        self._num_loading = 0
        self._idle = asyncio.Event()  # set when a model may have become unloadable
        self._wake: asyncio.Event | None = None  # the reaper's, made in its event loop
        self._reaper: asyncio.Task | None = None

    # ------------------------------------------------------------ the models
    @property
    def model_names(self) -> list[str]:
        """Every name a request may use, in order (the first is the default model's)."""
        return [n for s in self._slots for n in s.spec.names]

    @property
    def specs(self) -> list[ModelSpec]:
        """Every model the server can serve, in order."""
        return [s.spec for s in self._slots]

    @property
    def models(self) -> list[ServedModel]:
        """The models loaded now."""
        return [s.model for s in self._slots if s.model is not None]

    def loaded(self, name: str) -> ServedModel | None:
        """The model serving ``name`` if it is loaded now (None: not loaded); 404 for a
        name this server does not serve."""
        slot = self._slot(name)
        return None if slot.model is None else slot.model.named(name)

    def spec_of(self, name: str) -> ModelSpec:
        """The spec of the model serving ``name``; 404 for a name this server does not serve."""
        return self._slot(name).spec

    def add(self, spec: ModelSpec) -> None:
        """Make a model servable (loaded on its first request); ValueError for a name
        already served."""
        taken = [n for n in spec.names if n in self._by_name]
        if taken:
            raise ValueError(f"model name {taken[0]!r} is served already")
        slot = _Slot(spec, self.policy.keep_alive)
        self._slots.append(slot)
        for name in spec.names:
            self._by_name[name] = slot

    def alias(self, name: str, new_name: str) -> None:
        """Serve the model serving ``name`` under ``new_name`` too (Ollama's copy); 404 for
        an unknown ``name``, ValueError for a ``new_name`` served already."""
        slot = self._slot(name)
        if new_name in self._by_name:
            raise ValueError(f"model name {new_name!r} is served already")
        slot.spec = dataclasses.replace(slot.spec, names=(*slot.spec.names, new_name))
        self._by_name[new_name] = slot

    async def remove(self, name: str) -> ModelSpec:
        """Stop serving the model serving ``name`` (unloaded first); its spec. ValueError
        when it is the default model or a request uses it."""
        slot = self._slot(name)
        if slot is self._slots[0]:
            raise ValueError(f"{name!r} is the server's default model (its first)")
        await self._unload(slot, "removed")
        if slot.model is not None or slot.num_users:
            raise ValueError(f"{name!r} is in use; try again when its requests are over")
        self._slots.remove(slot)
        for n in slot.spec.names:
            del self._by_name[n]
        return slot.spec

    def _slot(self, name: str | None) -> _Slot:
        if name is None:
            return self._slots[0]
        slot = self._by_name.get(name)
        if slot is None:
            names = self.model_names
            shown = ", ".join(repr(n) for n in names[:20]) + (", ..." if len(names) > 20 else "")
            raise APIError(
                404,
                f"The model {name!r} does not exist; this server serves {shown}",
                param="model",
                code="model_not_found",
            )
        return slot

    def is_pinned(self, spec: ModelSpec) -> bool:
        return not self.policy.unloads or any(n in self.policy.pinned for n in spec.names)

    async def resolve(self, name: str | None) -> ServedModel:
        """The model serving ``name`` (the default model for None), reported under that
        name, loaded first if need be; 404 for a name this server does not serve.

        Within an HTTP request (ModelLeases) the model stays loaded until its response is
        sent."""
        slot = self._slot(name)
        leases = _LEASES.get()
        if leases is not None:
            slot.num_users += 1
            slot.expires_at = None
            # The latest request says how long the model stays (Ollama's rule): the
            # server's keep_alive unless it sets its own (set_keep_alive).
            slot.keep_alive = self.policy.keep_alive
            leases.append(_Lease(slot))
        model = slot.model
        if model is None:
            model = await self._load(slot)
        slot.last_used = time.monotonic()
        return model.named(name or model.name)

    async def model_or_default(self, name: str | None) -> ServedModel:
        """The model serving ``name``, or the default model for a name this server does not
        serve (routes that only count tokens and never refused an unknown name)."""
        return await self.resolve(name if name in self._by_name else None)

    async def _load(self, slot: _Slot) -> ServedModel:
        """Load the slot's model once: racing callers wait for the same load."""
        async with slot.lock:
            if slot.model is not None:  # loaded while this caller waited
                return slot.model
            if self.loader is None:
                raise APIError(503, f"the model {slot.name!r} is not loaded", code="not_loaded")
            self._num_loading += 1  # counted before making room: racing loads see it
            try:
                await self._make_room(slot)
                logger.info("loading model %r (%s) ...", slot.name, _what(slot.spec))
                start = time.monotonic()
                model = await asyncio.to_thread(self.loader, slot.spec)
            except APIError:  # no room (503)
                raise
            except Exception as e:  # noqa: BLE001 -- the request that asked hears why
                logger.exception("loading model %r failed", slot.name)
                raise APIError(500, f"loading the model {slot.name!r} failed: {e}") from None
            finally:
                self._num_loading -= 1
                self._idle.set()
            slot.model = model
            slot.num_loads += 1
            logger.info("loaded model %r in %.1f s", slot.name, time.monotonic() - start)
            self._touch(slot)
            return model

    async def _make_room(self, slot: _Slot) -> None:
        """Unload least recently used idle models until the loading ones (``slot``'s among
        them) fit max_loaded_models beside the loaded ones; wait ROOM_WAIT_S at most for
        one to become idle."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ROOM_WAIT_S
        while len(self.models) + self._num_loading > self.policy.max_loaded_models:
            idle = [
                s
                for s in self._slots
                if s is not slot
                and s.model is not None
                and not s.num_users
                and not self.is_pinned(s.spec)
            ]
            if not idle and loop.time() < deadline:
                self._idle.clear()
                try:
                    await asyncio.wait_for(self._idle.wait(), deadline - loop.time())
                except asyncio.TimeoutError:
                    pass
                continue
            if not idle:
                raise APIError(
                    503,
                    f"cannot load {slot.name!r}: {len(self.models)} models are loaded "
                    f"(--max-loaded-models {self.policy.max_loaded_models}) and each is in "
                    "use or pinned; try again when a request is over",
                    code="model_limit",
                )
            victim = min(idle, key=lambda s: s.last_used)
            await self._unload(victim, f"to load {slot.name!r} (least recently used)")

    async def unload(self, name: str, reason: str) -> bool:
        """Unload a model now unless it is in use; whether it was unloaded."""
        return await self._unload(self._slot(name), reason)

    async def _unload(self, slot: _Slot, reason: str) -> bool:
        async with slot.lock:
            model = slot.model
            if model is None or slot.num_users:
                return False
            slot.model = None  # from here on a request for it loads it again
            slot.expires_at = None
            logger.info("unloading model %r (%s)", slot.name, reason)
            await asyncio.to_thread(model.llm.shutdown)
            del model  # the last reference to its engine: its weights and KV pool go
            await asyncio.to_thread(_release_memory)
            logger.info("unloaded model %r", slot.name)
            return True

    def set_keep_alive(self, model: ServedModel, keep_alive: float | None) -> None:
        """This request's Ollama ``keep_alive`` for ``model``: how long it stays loaded once
        the request is over (0: unload then; None: for ever)."""
        for lease in _LEASES.get() or ():
            if model.name in lease.slot.spec.names:
                lease.slot.keep_alive = keep_alive

    def release(self, lease: _Lease) -> None:
        """A request is over with a model: once none uses it, it expires after its
        keep_alive (the latest request's)."""
        slot = lease.slot
        slot.num_users -= 1
        if not slot.num_users:
            self._touch(slot)
            self._idle.set()
            if self._wake is not None:
                self._wake.set()

    def _touch(self, slot: _Slot) -> None:
        now = time.monotonic()
        slot.last_used = now
        ttl = slot.keep_alive
        slot.expires_at = None if ttl is None or self.is_pinned(slot.spec) else now + ttl

    def expires_at(self, model: ServedModel) -> str:
        """When ``model`` unloads if no request comes (Ollama's expires_at, UTC ISO)."""
        slot = self._slot(model.name)
        if self.is_pinned(slot.spec) or slot.keep_alive is None:
            return FOREVER_ISO
        left = slot.keep_alive if slot.num_users else (slot.expires_at or 0) - time.monotonic()
        when = datetime.now(timezone.utc) + timedelta(seconds=max(left, 0.0))
        return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")

    def num_loads(self, name: str) -> int:
        """How many times the model serving ``name`` was loaded (start-up included)."""
        return self._slot(name).num_loads

    # ------------------------------------------------------ unloading idle ones
    def start(self) -> None:
        """Start unloading idle models (in the running event loop), if they unload."""
        self._wake = asyncio.Event()
        if self.policy.unloads:
            self._reaper = asyncio.create_task(self._reap())

    async def stop(self) -> None:
        """Stop unloading idle models."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None

    def shutdown(self) -> None:
        """Stop every loaded model's engine (the server is exiting)."""
        for slot in self._slots:
            if slot.model is not None:
                slot.model.llm.shutdown()

    async def _reap(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            now = time.monotonic()
            next_at: float | None = None
            for slot in self._slots:
                if slot.model is None or slot.num_users or slot.expires_at is None:
                    continue
                if slot.expires_at <= now:
                    idle = describe_keep_alive(slot.keep_alive)
                    try:
                        await self._unload(slot, f"keep_alive {idle} is over")
                    except Exception:  # noqa: BLE001 -- keep unloading the others
                        logger.exception("unloading model %r failed", slot.name)
                else:
                    next_at = slot.expires_at if next_at is None else min(next_at, slot.expires_at)
            timeout = None if next_at is None else max(next_at - time.monotonic(), 0.0)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    # --------------------------------------------------------------- state
    @property
    def is_running(self) -> bool:
        """Whether every loaded model's engine thread runs."""
        return all(m.llm.is_running for m in self.models)

    def check_accepting(self) -> None:
        """503 once a graceful shutdown has begun."""
        if self.in_flight.is_draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")


class ModelLeases:
    """ASGI middleware: the models a request resolves stay loaded until its response is
    sent (a stream's last byte included); then their keep_alive starts."""

    def __init__(self, app: Any, serving: Serving) -> None:
        self.app = app
        self.serving = serving

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[_Lease] = []
        token = _LEASES.set(leases)
        try:
            await self.app(scope, receive, send)
        finally:
            _LEASES.reset(token)
            for lease in leases:
                self.serving.release(lease)


def _what(spec: ModelSpec) -> str:
    model = spec.config.model if spec.config is not None else None
    return model or "the default model"


def _release_memory() -> None:
    """Give an unloaded model's memory back to the OS (in a worker thread)."""
    from mlxserve.utils import release_free_memory

    gc.collect()
    release_free_memory()
