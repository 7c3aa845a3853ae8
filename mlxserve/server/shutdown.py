"""Graceful shutdown of `mlxserve serve` (vLLM's --shutdown-timeout, bounded).

On the first SIGTERM or SIGINT the server stops taking work: the listening socket closes,
idle connections close, /health and new generation calls answer 503. Calls in flight may
finish for up to ``timeout`` seconds; then each one still running is failed with a 503
error (in-stream for an event stream) and the process exits. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn

from mlxserve.server.errors import APIError
from mlxserve.server.streams import InFlight

logger = logging.getLogger("mlxserve")

DEFAULT_SHUTDOWN_TIMEOUT = 5.0  # seconds; below Docker's 10 s and Kubernetes' 30 s SIGKILL
# After the abort, how long responses get to reach their clients before their tasks are
# cancelled (a client that does not read its stream would otherwise hold the exit).
ABORT_GRACE = 5.0
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def shutdown_error() -> APIError:
    """What a call still running at the end of the shutdown timeout gets."""
    return APIError(
        503,
        "the server is shutting down and the request did not finish within its shutdown "
        "timeout (--shutdown-timeout); retry it on another server",
        code="shutting_down",
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening), or ValueError naming host:port.

    Bound before the model loads, so a port in use fails the start at once.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        reason = "the address is already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise ValueError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a bounded drain and a second signal that exits at once."""

    def __init__(self, config: uvicorn.Config, in_flight: InFlight, timeout: float) -> None:
        super().__init__(config)
        self.in_flight = in_flight
        self.timeout = timeout
        # uvicorn waits this long for connections before cancelling their tasks.
        config.timeout_graceful_shutdown = timeout + ABORT_GRACE

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Install handle_exit for SIGINT/SIGTERM; unlike uvicorn, never re-raise them after."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            # A second signal: the user does not want to wait for the drain.
            print(f"{name} again: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        self.in_flight.start_draining()
        logger.info(
            "%s: shutting down; %d request(s) in flight get up to %g s to finish "
            "(--shutdown-timeout); send the signal again to exit now",
            name,
            len(self.in_flight),
            self.timeout,
        )
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.in_flight.start_draining()  # also when uvicorn stops for another reason
        abort = asyncio.create_task(self._abort_after_timeout())
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()

    async def _abort_after_timeout(self) -> None:
        await asyncio.sleep(self.timeout)
        num_failed = self.in_flight.fail_all(shutdown_error())
        if num_failed:
            logger.warning(
                "shutdown timeout (%g s) reached: aborted %d request(s) still running",
                self.timeout,
                num_failed,
            )
