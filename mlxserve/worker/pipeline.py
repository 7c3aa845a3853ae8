"""Pipeline-parallel ranks r > 0: run this rank's stage of every forward rank 0 sends.

Rank 0 runs its stage inside the engine's lazy step (``PipelineStage.__call__``); a rank
r > 0 evaluates its side one piece at a time, which orders its collectives and tells
where its time goes::

    for each micro-batch:  recv h from rank r-1  (waiting)
                           its layers, send h to rank r+1 / keep it (busy)
    then, if rank 0 needs rows:  last rank: norm + LM head -> all_sum; others: zeros

Counters (seconds and bytes, read by rank 0 with ``StepChannel.gather_stats``): waiting
for the step's message, waiting for micro-batches, computing (sends included) and the
logits' return. The idle share of a rank is its waiting over the wall time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import mlx.core as mx

from mlxserve import ops
from mlxserve.config import EngineConfig
from mlxserve.loader import LoadedModel
from mlxserve.models.pipeline_parallel import PipelineStage, micro_batch_metadata, micro_batches
from mlxserve.worker.model_runner import ModelRunner
from mlxserve.worker.spmd import ForwardInputs, RankLostError, StepChannel, serve_forwards

logger = logging.getLogger("mlxserve")

STAT_NAMES = (
    "forwards",
    "message_wait_s",  # between forwards: rank 0 schedules, samples, sends the message
    "micro_batch_wait_s",  # inside a forward: the previous stage has not sent yet
    "busy_s",  # this rank's layers (and its sends)
    "return_s",  # the head and the logits' all_sum (the last rank), or waiting in it
    "bytes_received",
    "bytes_sent",
    "wall_s",
    "tail_s",  # from the last micro-batch's arrival to the forward's end: rank 0 waits it
    "micro_batches",
)


@dataclass
class StageCounters:
    """Where a rank r > 0 spent its time, since it started serving."""

    forwards: int = 0
    message_wait: float = 0.0
    micro_batch_wait: float = 0.0
    busy: float = 0.0
    returning: float = 0.0
    bytes_received: int = 0
    bytes_sent: int = 0
    tail: float = 0.0
    micro_batches: int = 0
    started: float = 0.0
    last_end: float | None = None

    def as_list(self) -> list[float]:
        wall = time.perf_counter() - self.started if self.started else 0.0
        return [
            self.forwards,
            self.message_wait,
            self.micro_batch_wait,
            self.busy,
            self.returning,
            self.bytes_received,
            self.bytes_sent,
            wall,
            self.tail,
            self.micro_batches,
        ]


class StageRunner:
    """Rank r > 0 of a pipeline: its stage of each forward, on its runner's KV pool."""

    def __init__(self, runner: ModelRunner, stage: PipelineStage) -> None:
        self.runner = runner
        self.stage = stage
        self.counters = StageCounters(started=time.perf_counter())

    def run(self, inputs: ForwardInputs) -> None:
        """Receive, run and pass on every micro-batch of ``inputs``; the logits if needed."""
        stage, c = self.stage, self.counters
        group = stage.pp_group
        t = time.perf_counter()
        if c.last_end is not None:
            c.message_wait += t - c.last_end
        self.runner.ensure_blocks(inputs.num_blocks)
        cache = self.runner.kv_cache
        md = inputs.metadata(self.runner.block_size)
        positions = mx.array(inputs.positions(), dtype=mx.int32)
        outs = []
        with ops.use_kernels(self.runner.kernels):
            for a, b in micro_batches(md.query_lens, stage.size, stage.micro_batch_tokens):
                sub, t0, t1 = micro_batch_metadata(md, a, b)
                h = mx.distributed.recv(
                    (t1 - t0, stage.hidden_size), stage.hidden_dtype, stage.rank - 1, group=group
                )
                mx.eval(h)
                now = time.perf_counter()
                c.micro_batch_wait += now - t
                c.bytes_received += h.nbytes
                c.micro_batches += 1
                t = last_arrival = now
                h = stage.run_layers(h, positions[t0:t1], sub, cache)
                if stage.is_last:
                    mx.eval(h, cache.arrays())
                    outs.append(h)
                else:
                    mx.eval(mx.distributed.send(h, stage.rank + 1, group=group), cache.arrays())
                    c.bytes_sent += h.nbytes
                now = time.perf_counter()
                c.busy += now - t
                t = now
            if inputs.logits_rows:
                self._return(inputs, outs)
        now = time.perf_counter()
        c.returning += now - t
        c.tail += now - last_arrival
        c.forwards += 1
        c.last_end = now

    def _return(self, inputs: ForwardInputs, outs: list[mx.array]) -> None:
        """The rows rank 0 needs: logits (and hidden states), summed into rank 0's zeros."""
        stage = self.stage
        k = inputs.num_hidden_rows
        n = len(inputs.logits_rows) - k
        if stage.is_last:
            h = mx.concatenate(outs) if len(outs) > 1 else outs[0]
            rows = mx.array(inputs.logits_rows, dtype=mx.int32)
            logits, hidden = stage.head(h, rows, k)
        else:
            logits = mx.zeros((n, stage.vocab_size), dtype=stage.logits_dtype)
            hidden = mx.zeros((k, stage.hidden_size), dtype=stage.hidden_dtype) if k else None
        arrays = [a for a in (logits, hidden) if a is not None and a.shape[0]]
        out = [mx.distributed.all_sum(a, group=stage.pp_group) for a in arrays]
        mx.eval(out)
        if stage.is_last:
            self.counters.bytes_sent += sum(a.nbytes for a in arrays)


def serve_pipeline_rank(
    loaded: LoadedModel, config: EngineConfig, plan: dict, group: mx.distributed.Group
) -> int:
    """Keep this rank's layers of ``loaded.model`` (the others are freed), plan its KV pool
    with the other ranks, run its stage of every forward until STOP; the exit status (1
    if another rank was lost)."""
    try:
        stage = PipelineStage(loaded.model, group, config.pipeline_micro_batch_tokens)
        loaded.model = stage  # the only reference to the whole model goes
        runner = ModelRunner(
            stage,
            dtype=loaded.dtype,
            block_size=config.block_size,
            kernels=config.kernels,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        runner.plan_kv_cache(**plan)
        worker = StageRunner(runner, stage)
        channel = StepChannel(group, lambda: None, name="pipeline parallel")
        serve_forwards(worker.run, channel, worker.counters.as_list)
    except RankLostError as e:
        logger.error("rank %d: %s", group.rank(), e)
        return 1
    return 0
