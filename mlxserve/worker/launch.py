"""Starting tensor- or pipeline-parallel ranks on this machine, the way ``mlx.launch`` does.

``mlx.launch --backend ring`` starts each rank with ``MLX_RANK`` and ``MLX_HOSTFILE`` (a
JSON list of ``["ip:port"]`` per rank) in its environment; ``mx.distributed.init``
reads them. :class:`LocalRanks` does the same from inside the engine's process, which
becomes rank 0, so ``LLM(model, tensor_parallel_size=2)`` works in a plain script::

    rank 0 (this process)                 rank r = python -m mlxserve.worker.rank SPEC
      spawn ranks 1..N-1 ------------->     report "ready" on a pipe, then init the ring
      wait for every "ready"                load the model, shard it, plan the KV pool
      init the ring (127.0.0.1 ports)       serve_forwards() until STOP or a lost peer
      load, shard, plan (collectives) <->   (the same collectives)

Waiting for "ready" before joining the ring keeps a rank that cannot even start (bad
interpreter, import error) from leaving rank 0 blocked in ``init``, which has no
timeout. After that, a rank that exits closes its sockets and rank 0's next collective
fails (RankLostError). A rank whose parent dies exits on its own (it polls its parent).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import mlx.core as mx

from mlxserve.config import EngineConfig
from mlxserve.exceptions import ParameterError
from mlxserve.loader import LoadedModel
from mlxserve.models.pipeline_parallel import PipelineStage, check_pipeline_parallel
from mlxserve.models.tensor_parallel import check_tensor_parallel, shard_model
from mlxserve.worker.model_runner import ModelRunner
from mlxserve.worker.pipeline import serve_pipeline_rank
from mlxserve.worker.spmd import RankLostError, StepChannel, serve_forwards

logger = logging.getLogger("mlxserve")

READY_TIMEOUT = 120.0  # seconds for a rank's interpreter to start and import MLX
STOP_TIMEOUT = 10.0  # seconds for a rank to leave after STOP, then it is killed
# Seconds the engine has, after a rank exited, to notice (RankLostError) before the
# watchdog ends this process: a collective queued on a broken ring can block for good
# (seen under CI load: MLX's ring "failed pending tasks" and the step never returned).
# Either way the callers get the error: the watchdog fails them itself (``before_exit``)
# and gives the server FLUSH_SECONDS to send it before the process exits.
LOST_GRACE = 10.0
FLUSH_SECONDS = 2.0

_group_made = False  # MLX keeps one global group per process


def exit_lost(
    name: str, why: str, before_exit: Callable[[str], None] | None, detail: str = ""
) -> NoReturn:
    """End this process (status 1) because the group is broken and the engine cannot
    say so itself: first hand the reason to ``before_exit`` (the server fails the calls
    in flight with it) and give it FLUSH_SECONDS to reach the callers."""
    reason = f"{name}: a rank is gone ({why}); the engine stops"
    logger.critical("%s%s; exiting this process (status 1)", reason, detail)
    if before_exit is not None:
        try:
            before_exit(reason)
            time.sleep(FLUSH_SECONDS)
        except Exception:  # noqa: BLE001 -- exiting regardless
            logger.exception("failing the requests in flight")
    os._exit(1)


def free_ports(count: int) -> list[int]:
    """``count`` TCP ports free on 127.0.0.1 right now."""
    sockets = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def launched_rank() -> int | None:
    """This process's rank when a launcher (``mlx.launch``, mpirun) started it, else None."""
    rank = os.environ.get("MLX_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
    return None if rank is None else int(rank)


def parallel_name(config: EngineConfig) -> str:
    """ "tensor parallel" or "pipeline parallel", for messages."""
    return "pipeline parallel" if config.pipeline_parallel_size > 1 else "tensor parallel"


class Progress:
    """Which step (or start-up phase) the engine is in and since when: a watchdog reads it
    to tell a stuck rank (rank 0 waits in a collective that never completes) from work."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._since: float | None = None
        self._what = ""

    def begin(self, what: str) -> None:
        self._what, self._since = what, time.monotonic()

    def end(self) -> None:
        self._since = None

    def stuck(self) -> str | None:
        """Why the group looks stuck, or None while the current step is within its time."""
        since = self._since
        if since is None or time.monotonic() - since <= self.timeout:
            return None
        return (
            f"{self._what} made no progress for {self.timeout:g} s "
            "(distributed_timeout_seconds): a rank stopped responding"
        )


class LaunchedRanks:
    """The group ``mlx.launch`` made (any backend, any hosts); the launcher owns the
    processes: it stops them all when one fails. A stuck group ends this process."""

    def __init__(self, config: EngineConfig) -> None:
        global _group_made
        size = config.world_size
        self.group = mx.distributed.init(strict=True)
        _group_made = True
        if self.group.size() != size:
            name = (
                "pipeline_parallel_size"
                if config.pipeline_parallel_size > 1
                else "tensor_parallel_size"
            )
            raise ParameterError(
                f"{name} {size} differs from the {self.group.size()} processes "
                "the launcher started; give it the same number",
                parameter=name,
            )
        self.name = parallel_name(config)
        self.progress = Progress(config.distributed_timeout_seconds)
        # Called with the reason just before a broken group ends this process (AsyncLLM
        # fails the requests in flight with it).
        self.before_exit: Callable[[str], None] | None = None
        if self.group.rank() == 0:
            threading.Thread(target=self._watch, name="mlxserve-ranks", daemon=True).start()

    def _watch(self) -> None:
        """Remote ranks cannot be stopped from here: a stuck group ends this process,
        and the launcher then stops the others."""
        while (why := self.progress.stuck()) is None:
            time.sleep(0.25)
        exit_lost(self.name, why, self.before_exit)

    def lost(self) -> str | None:
        return None  # remote processes: only a broken connection tells

    def wait(self, timeout: float = STOP_TIMEOUT) -> None:
        """Nothing to reap: the launcher does."""

    def kill(self) -> None:
        """Nothing to kill: the launcher stops the others when this process exits."""


class LocalRanks:
    """Ranks 1..N-1 as child processes of this one (rank 0) on the ring backend."""

    def __init__(self, config: EngineConfig, plan_args: dict[str, object]) -> None:
        global _group_made
        size = config.world_size
        self.name = name = parallel_name(config)
        if _group_made:
            raise RuntimeError(
                f"this process already started a {name} group; MLX has one per "
                "process: start another engine in another process"
            )
        self.progress = Progress(config.distributed_timeout_seconds)
        self.before_exit: Callable[[str], None] | None = None  # as LaunchedRanks's
        self._stuck: str | None = None  # why the ranks were stopped as stuck
        fd, self.hostfile = tempfile.mkstemp(prefix="mlxserve-ranks-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([[f"127.0.0.1:{p}"] for p in free_ports(size)], f)
        spec = json.dumps({"config": dataclasses.asdict(config), "plan": plan_args})
        self.procs: list[subprocess.Popen] = []
        ready = []
        atexit.register(self.stop)
        try:
            for rank in range(1, size):
                read_fd, write_fd = os.pipe()
                env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=self.hostfile)
                cmd = [sys.executable, "-m", "mlxserve.worker.rank", spec, str(write_fd)]
                proc = subprocess.Popen(
                    cmd, env=env, pass_fds=(write_fd,), stdin=subprocess.DEVNULL
                )
                os.close(write_fd)
                self.procs.append(proc)
                ready.append(read_fd)
            self._wait_ready(ready)
        except BaseException:
            self.kill()
            raise
        finally:
            for read_fd in ready:
                os.close(read_fd)
        saved = {k: os.environ.get(k) for k in ("MLX_RANK", "MLX_HOSTFILE")}
        os.environ.update(MLX_RANK="0", MLX_HOSTFILE=self.hostfile)
        try:
            self.group = mx.distributed.init(strict=True, backend="ring")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _group_made = True
        assert self.group.size() == size and self.group.rank() == 0, self.group
        self._closing = False
        threading.Thread(target=self._watch, name="mlxserve-ranks", daemon=True).start()
        logger.info(
            "%s: %d ranks on 127.0.0.1 (ring backend); ranks 1-%d are pids %s",
            name,
            size,
            size - 1,
            " ".join(str(p.pid) for p in self.procs),
        )

    def _wait_ready(self, fds: list[int]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        pending = dict(zip(fds, range(1, len(fds) + 1), strict=True))
        while pending:
            why = self.lost()
            if why is not None:
                raise RuntimeError(f"{self.name}: {why} before joining the group")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"{self.name}: rank(s) {sorted(pending.values())} did not start "
                    f"within {READY_TIMEOUT:.0f} s"
                )
            readable, _, _ = select.select(list(pending), [], [], min(left, 0.5))
            for fd in readable:
                os.read(fd, 16)
                del pending[fd]

    def _watch(self) -> None:
        """If a rank exits and the engine has not failed within LOST_GRACE seconds (it
        is idle, or blocked in a collective MLX cannot interrupt), say so and end the
        process, killing the other ranks first: a dead group never hangs or lingers.

        A step that makes no progress for ``distributed_timeout_seconds`` means a rank is
        stuck (alive, not answering): the ranks are killed, so their closed connections
        fail rank 0's collective like a crash does, and the engine fails with that reason.
        """
        while not self._closing:
            why = self.lost()
            if why is None:
                stuck = self.progress.stuck()
                if stuck is not None:
                    logger.error("%s: %s; stopping the ranks", self.name, stuck)
                    self._stuck = stuck
                    self._kill_ranks()
                time.sleep(0.25)
                continue
            deadline = time.monotonic() + LOST_GRACE
            while not self._closing and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._closing:
                return
            self.kill()
            detail = (
                f"; the engine did not stop within {LOST_GRACE:.0f} s (idle, or blocked "
                "in a collective that cannot be interrupted)"
            )
            exit_lost(self.name, why, self.before_exit, detail)

    def lost(self) -> str | None:
        """Which rank has exited and how (or why the ranks were stopped), or None while
        all run."""
        if self._stuck is not None:
            return self._stuck
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                return f"rank {rank} exited ({how})"
        return None

    def wait(self, timeout: float = STOP_TIMEOUT) -> None:
        """After STOP: let the ranks leave, kill those that do not."""
        self._closing = True  # their exits are expected now
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def _kill_ranks(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()

    def kill(self) -> None:
        """Kill every rank still running and reap them (idempotent)."""
        self._closing = True
        self._kill_ranks()
        if os.path.exists(self.hostfile):
            os.unlink(self.hostfile)

    def stop(self) -> None:
        """At exit: no rank outlives this process."""
        self.kill()


def start_ranks(
    loaded: LoadedModel, config: EngineConfig, plan_args: dict[str, object]
) -> LocalRanks | LaunchedRanks:
    """Rank 0's view of the group: the ranks started here on 127.0.0.1, or the group
    ``mlx.launch`` made. Under mlx.launch every rank runs the caller's script: a rank
    r > 0 serves rank 0's forwards here and exits. ParameterError first if the model
    cannot be split that way."""
    if config.pipeline_parallel_size > 1:
        check_pipeline_parallel(loaded.model, config.pipeline_parallel_size)
    else:
        check_tensor_parallel(loaded.model, config.tensor_parallel_size)
    if launched_rank() is None:
        return LocalRanks(config, plan_args)
    ranks = LaunchedRanks(config)
    if ranks.group.rank() != 0:
        sys.exit(serve_rank(loaded, config, plan_args, ranks.group))
    return ranks


def keep_this_ranks_part(
    loaded: LoadedModel, config: EngineConfig, group: mx.distributed.Group
) -> None:
    """Tensor parallel: shard ``loaded.model`` in place; pipeline parallel: replace it
    with this rank's stage (the other layers are freed with the model)."""
    if config.pipeline_parallel_size == 1:
        shard_model(loaded.model, group)
        return
    stage = PipelineStage(loaded.model, group, config.pipeline_micro_batch_tokens)
    loaded.model = stage
    if group.rank() == 0:
        ranges = ", ".join(
            f"rank {r}: layers {a}-{b - 1}" for r, (a, b) in enumerate(stage.layer_ranges)
        )
        logger.info("pipeline parallel: %s", ranges)


def serve_rank(
    loaded: LoadedModel, config: EngineConfig, plan: dict, group: mx.distributed.Group
) -> int:
    """Keep this rank's shard (or layers) of ``loaded.model``, plan the KV pool with rank 0,
    run forwards until STOP; the exit status (1 if another rank was lost)."""
    if config.pipeline_parallel_size > 1:
        return serve_pipeline_rank(loaded, config, plan, group)
    try:
        shard_model(loaded.model, group)
        runner = ModelRunner(
            loaded.model,
            dtype=loaded.dtype,
            block_size=config.block_size,
            kernels=config.kernels,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        runner.plan_kv_cache(**plan)
        serve_forwards(runner.run_forward, StepChannel(group, lambda: None))
    except RankLostError as e:
        logger.error("rank %d: %s", group.rank(), e)
        return 1
    return 0
