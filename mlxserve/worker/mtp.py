"""The MTP proposer on the device: the checkpoint's own MTP layer drafts (models/mtp.py).

An MTP layer at position i needs the target's last hidden state at i and the token at
i + 1, so it runs on the target's side of the step, not before it. Its KV pool has the
target's block ids (as a draft model's, worker/drafter.py: blocks, preemption and prefix
caching need nothing of their own). One step, all lazy, evaluated with the target::

    propose:  g (kept from the last step: the MTP output at the request's last verified
              position T-2) -> d0; then d(j-1) and g at position T-1+j-1 -> g' -> dj
    target:   t d0 .. d(k-1) verified; its pre-norm hidden states kept (capture_prenorm)
    follow:   every row the target computed, at its position p: the MTP layer with the
              target's hidden state at p and the token at p + 1 (the next input row, the
              next prompt token, or what the sampler settled on: the draft if accepted,
              else the sampled token). Rows past the first rejection write K/V at
              positions that are rewritten before they are read. g at the last verified
              row (picked on the device from the acceptance) is kept for the next step;
              a prompt chunk's last row too (a request whose last prompt token is left
              verifies drafts with it).

So the MTP layer's KV is valid up to the target's num_computed_tokens after every step,
with no catch-up to schedule; a prefix-cache hit drops its last block (the scheduler,
as vLLM does for EAGLE/MTP): the MTP K/V at a block's last position was written with
the token after the block, which the block's hash does not cover.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

import mlx.core as mx

from mlxserve.core.request import Request
from mlxserve.core.scheduler_output import SchedulerOutput
from mlxserve.exceptions import ParameterError
from mlxserve.kv_cache_spec import FULL_ATTENTION
from mlxserve.models.mtp import (
    MTP_ARCHITECTURES,
    MtpLayer,
    build_mtp_layer,
    capture_prenorm,
    hook_final_norm,
    mtp_weight_names,
)
from mlxserve.ops import AttentionMetadata
from mlxserve.worker.drafter import Drafter, Proposal, draft_passes
from mlxserve.worker.sampler import SamplerOutput, SamplingState

logger = logging.getLogger("mlxserve")

_FIELD = "speculative_config.method"


class MtpDrafter(Drafter):
    """The MTP layer as a proposer: a KV pool on the target's block ids, g per request."""

    model: MtpLayer

    def __init__(self, layer: MtpLayer, *, dtype: mx.Dtype, block_size: int, vocab_size: int):
        super().__init__(layer, dtype=dtype, block_size=block_size, vocab_size=vocab_size)
        # request_id -> (1, hidden): the MTP output at its last verified position.
        self._last: dict[str, mx.array] = {}

    def proposes(self, so: SchedulerOutput) -> bool:
        return bool(so.draft_token_ids)

    def capture(self) -> AbstractContextManager[list[mx.array] | None]:
        return capture_prenorm()

    def save(self) -> tuple:
        return (*super().save(), dict(self._last))

    def restore(self, saved: tuple) -> None:
        keys, values, last = saved
        super().restore((keys, values))
        self._last = last

    def drop(self) -> None:
        super().drop()
        self._last.clear()

    # ------------------------------------------------------------------ a step
    def propose(
        self, so: SchedulerOutput, sampling: Callable[[Request, int], SamplingState]
    ) -> Proposal | None:
        """k drafts for each request that verifies drafts this step, from the g kept for
        it (zeros if none: drafts then still get verified, just rarely accepted)."""
        assert self.kv_cache is not None, "ensure_blocks() comes before the first step"
        drafting = [r for r in so.scheduled_requests if so.draft_token_ids.get(r.request_id)]
        if not drafting:
            return None
        layer = self.model
        zeros = mx.zeros((1, layer.hidden_size), dtype=layer.enorm.weight.dtype)
        g = mx.concatenate([self._last.get(r.request_id, zeros) for r in drafting])  # (R, H)
        kept = list(range(len(drafting)))  # the requests g's rows are for

        def next_pass(rows: list[int], j: int, fed: mx.array) -> mx.array:
            # Draft j + 1's input: draft j at position T - 1 + j, with g of the position
            # before (the rows of g kept for these requests).
            nonlocal g, kept
            g = g[mx.array([kept.index(i) for i in rows], dtype=mx.int32)]
            kept = rows
            positions = [drafting[i].num_tokens - 1 + j for i in rows]
            md = AttentionMetadata.build(
                [1] * len(rows),
                [p + 1 for p in positions],
                [so.block_ids[drafting[i].request_id][0] for i in rows],
                self.block_size,
            )
            g = layer.forward(fed, mx.array(positions, dtype=mx.int32), g, md, self.kv_cache)
            return layer.logits(g)

        return draft_passes(so, drafting, sampling, self.vocab_size, layer.logits(g), next_pass)

    def follow(
        self,
        so: SchedulerOutput,
        ids: mx.array,  # (T,) int32: the step's input rows (drafts in place)
        captured: list[mx.array],  # capture_prenorm's box of the target's forward
        md: AttentionMetadata,  # the target's (its first KV cache group)
        result: SamplerOutput | None,
    ) -> list[mx.array]:
        """Run the MTP layer over every row the target computed (see the module
        docstring); keep g at each request's last verified row. Returns the arrays the
        step must evaluate besides the pool."""
        for rid in so.finished_request_ids:
            self._last.pop(rid, None)
        assert len(captured) == 1, "one target forward per step"
        hidden = captured[0][:, 0, :]  # (T, hidden)
        num_rows = ids.shape[0]
        next_ids = ids[mx.minimum(mx.arange(1, num_rows + 1), num_rows - 1)]  # the next row's
        positions: list[int] = []
        fixed_rows, fixed_ids = [], []  # next tokens known on the host
        sample_rows: list[int] = []  # rows whose next token the sampler settles
        carried: list[tuple[str, int, int, int]] = []  # (rid, row0, first sampler row, k)
        row0 = num_samples = 0
        for req in so.scheduled_requests:
            rid = req.request_id
            n, start = so.num_scheduled_tokens[rid], so.start_positions[rid]
            positions += range(start, start + n)
            spec = so.draft_token_ids.get(rid, [])
            last = row0 + n - 1
            if so.samples(rid) and req.pooling is None:
                sample_rows += range(last - len(spec), last + 1)
                carried.append((rid, last - len(spec), num_samples, len(spec)))
                num_samples += len(spec) + 1
            else:  # a prompt chunk: the prompt's next token (none after an embedding's)
                after = req.get_token_ids(start + n, start + n + 1)
                fixed_rows.append(last)
                fixed_ids.append(after[0] if after else 0)
                if req.pooling is None:  # its last prompt token may come with drafts
                    carried.append((rid, last, 0, 0))
            row0 += n
        if fixed_rows:
            next_ids[mx.array(fixed_rows, dtype=mx.int32)] = mx.array(fixed_ids, dtype=mx.int32)
        if sample_rows:
            assert result is not None
            rows = mx.array(sample_rows, dtype=mx.int32)
            # A row's result: its draft when accepted, else what the target sampled there.
            next_ids[rows] = result.token_ids.astype(mx.int32)
        g = self.model.forward(
            next_ids, mx.array(positions, dtype=mx.int32), hidden, md, self.kv_cache
        )  # (T, hidden)
        # Not the pool arrays: the runner evaluates those, and a step's part must not hold
        # them (it outlives the step, and the next step's write could not be in place).
        out: list[mx.array] = []
        if carried:
            index = []
            for _, first_row, first_sample, k in carried:
                at = mx.array(first_row)
                if k:  # + the number of leading accepted drafts
                    accepted = result.accepted[first_sample : first_sample + k]
                    at = at + mx.cumprod(accepted.astype(mx.int32)).sum()
                index.append(at)
            kept = g[mx.stack(index)]  # (len(carried), hidden)
            for n, (rid, *_) in enumerate(carried):
                self._last[rid] = kept[n : n + 1]
            out.append(kept)
        return out


def load_mtp(config, loaded, runner) -> MtpDrafter:
    """The MTP layer of the engine's model (``speculative_config.method`` mtp), checked and
    loaded from its checkpoint; ParameterError naming the field when it cannot draft."""
    from mlxserve.loader.local import read_model_dir
    from mlxserve.models.mlx_lm_adapter import MlxLmModel

    model_type = loaded.config.get("model_type")
    name = loaded.source.name
    if runner.layout.has_state:
        raise ParameterError(
            f"speculative_config.method 'mtp': {name} ({model_type}) has recurrent layers, "
            "whose state cannot roll back past rejected drafts: no speculation for it yet",
            parameter=_FIELD,
        )
    if model_type not in MTP_ARCHITECTURES or not isinstance(loaded.model, MlxLmModel):
        raise ParameterError(
            f"speculative_config.method 'mtp': {name} is a {model_type!r} model; MTP layers "
            f"are supported for {', '.join(sorted(MTP_ARCHITECTURES))}",
            parameter=_FIELD,
        )
    if loaded.source.kind != "dir":
        raise ParameterError(
            f"speculative_config.method 'mtp': {name} is a {loaded.source.kind} file; the MTP "
            "layer is read from a safetensors checkpoint directory",
            parameter=_FIELD,
        )
    checkpoint_config, weights = read_model_dir(loaded.source.path)
    found = mtp_weight_names(model_type, checkpoint_config, list(weights))
    if not found or not checkpoint_config.get("num_nextn_predict_layers", 1):
        n = checkpoint_config["num_hidden_layers"]
        raise ParameterError(
            f"speculative_config.method 'mtp': {name} has no MTP layer weights (expected "
            f"{MTP_ARCHITECTURES[model_type].prefix.format(n=n, i=0)}*; conversions made "
            "with mlx-lm drop them)",
            parameter=_FIELD,
        )
    layer = build_mtp_layer(
        loaded.model, checkpoint_config, {k: weights[k] for k in found}, loaded.dtype
    )
    hook_final_norm(loaded.model)
    drafter = MtpDrafter(
        layer, dtype=runner.kv_dtype, block_size=runner.block_size, vocab_size=runner.vocab_size
    )
    target = runner.layout
    if target.num_groups != 1 or target.groups[0].kind != FULL_ATTENTION:
        raise ParameterError(
            f"speculative_config.method 'mtp': {name} has other KV cache groups than one "
            f"of full attention ({target.describe()})",
            parameter=_FIELD,
        )
    logger.info(
        "MTP layer of %s: %.0f MiB of weights, %d KiB of KV per block",
        name,
        drafter.weights_bytes / 2**20,
        drafter.layout.bytes_per_block(runner.block_size, runner.kv_dtype) // 1024,
    )
    return drafter
