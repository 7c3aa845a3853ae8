"""The draft-model proposer on the device: a second model, its own KV pool, k drafts a step.

The draft model's pool has the target's block ids and block size, and every draft row is
written at the slot the target's block table gives (group 0, full attention), so block
allocation, freeing and preemption need nothing of their own; memory planning counts
both pools (ModelRunner.plan_kv_cache). Which positions of it are valid for a request is
the scheduler's business (``Request.num_drafter_tokens``, core/spec_decode.py).

One step, all lazy and evaluated with the target's forward (no extra wait)::

    pass 0:  each followed request's catch-up tokens [start, end)   (a varlen batch)
             -> d0 from the last row of each request that verifies drafts this step
    pass j:  d(j-1) of the requests with more than j drafts          (decode rows)
             -> dj
    target:  t d0 .. d(k-1) verified (worker/sampler.py, with q = the draft's probabilities)

Drafts are sampled as the request would sample (its temperature, top-k/p, min-p, bias,
min_tokens), from their own noise keys; the rejection rule needs the distribution q each
draft was drawn from, which goes with it (greedy requests: the draft's argmax, checked
for equality with the target's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from mlxserve.core.request import Request
from mlxserve.core.scheduler_output import SchedulerOutput
from mlxserve.kv_cache_spec import FULL_ATTENTION, KVCacheLayout, uniform_layout
from mlxserve.models.base import KVCache
from mlxserve.models.contract import LayoutModel
from mlxserve.ops import AttentionMetadata
from mlxserve.worker.memory import PROBE_TOKENS, probe_activation_bytes, tree_bytes
from mlxserve.worker.sampler import (
    SamplingBatch,
    SamplingState,
    apply_logits_processors,
    filter_logits,
    gumbel_rows,
    make_sampling_batch,
)

logger = logging.getLogger("mlxserve")

_DRAFT_TAG = 0x2545F4914F6CDD1D  # mixed into a row's key for the draft's own noise
_SEED_MASK = (1 << 63) - 1
# Compared between the two tokenizers: words, code, digits, whitespace, non-ASCII.
PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog.\n\ndef add(a, b):\n    return a + b  # 42\n"
    "Größe, naïve café, 東京, emoji 🙂, tabs\tand   spaces."
)


@dataclass
class Proposal:
    """One step's drafts, lazy: batch order of the requests that verify drafts, each
    request's k drafts in a row."""

    token_ids: mx.array  # (num_drafts,) int32
    probs: mx.array | None  # (num_drafts, vocab) float32 q of each draft; None: all greedy

    def sample_rows(
        self, draft_ids: list[int], rows: list[int]
    ) -> tuple[mx.array, mx.array | None]:  # (N,) int32, (N, vocab) float32 or None
        """The sampler's per-row drafts and q: ``draft_ids`` (-1 where a row has none)
        with the drafts put at ``rows``, and q there (zeros elsewhere)."""
        index = mx.array(rows, dtype=mx.int32)
        ids = mx.array(draft_ids, dtype=mx.int32)
        ids[index] = self.token_ids
        if self.probs is None:
            return ids, None
        probs = mx.zeros((len(draft_ids), self.probs.shape[-1]), dtype=mx.float32)
        probs[index] = self.probs
        return ids, probs

    def read(self, placeholders: list[list[int]]) -> list[list[int]]:
        """The drafts on the host (after evaluation), shaped as the placeholders."""
        values = iter(np.array(self.token_ids).tolist())
        return [[next(values) for _ in spec] for spec in placeholders]


class Drafter:
    """A draft model running on the target's block tables, with a K/V pool of its own."""

    def __init__(self, model, *, dtype: mx.Dtype, block_size: int, vocab_size: int) -> None:
        self.model = model
        self.dtype = dtype  # the pool's (the target's KV dtype)
        self.block_size = block_size
        self.vocab_size = vocab_size  # the target's: drafts' probabilities are this wide
        self.layout: KVCacheLayout = (
            model.kv_cache_layout
            if isinstance(model, LayoutModel)
            else uniform_layout(model.num_layers, model.num_kv_heads, model.head_dim)
        )
        self._takes_layout = isinstance(model, LayoutModel)
        self.kv_cache: KVCache | None = None

    @property
    def weights_bytes(self) -> int:
        return tree_bytes(self.model.parameters())

    def planning_layout(self, target: KVCacheLayout) -> KVCacheLayout:
        """The target's layout with this model's K/V tensors added: one block id costs both."""
        return replace(target, tensor_shapes=target.tensor_shapes + self.layout.tensor_shapes)

    def probe_activation_bytes(self, max_num_batched_tokens: int) -> float:
        """This model's activation peak per token (it runs in the same step as the target)."""
        n = min(PROBE_TOKENS, max_num_batched_tokens)
        return probe_activation_bytes(self.model, self._allocate, self._extra, self.block_size, n)

    def _allocate(self, num_blocks: int) -> KVCache:
        return KVCache.allocate_layout(self.layout, num_blocks, self.block_size, self.dtype)

    def _extra(self, md: AttentionMetadata) -> dict[str, object]:
        return {"group_metadata": (md,), "state_metadata": None} if self._takes_layout else {}

    def ensure_blocks(self, num_blocks: int) -> None:
        """Hold as many blocks as the target's pool (new ones zeroed, lazily)."""
        if self.kv_cache is None:
            self.kv_cache = self._allocate(num_blocks)
        else:
            self.kv_cache.ensure_num_blocks(num_blocks)

    def arrays(self) -> list[mx.array]:
        return [] if self.kv_cache is None else self.kv_cache.arrays()

    def save(self) -> tuple[list[mx.array], list[mx.array]]:
        assert self.kv_cache is not None
        return list(self.kv_cache.keys), list(self.kv_cache.values)

    def restore(self, saved: tuple[list[mx.array], list[mx.array]]) -> None:
        """Put back the pool of before a failed build (drops its lazy writes)."""
        assert self.kv_cache is not None
        self.kv_cache.keys[:], self.kv_cache.values[:] = saved

    def drop(self) -> None:
        """Forget the pool (the target's was lost); the next ensure_blocks makes a new one."""
        self.kv_cache = None

    # ------------------------------------------------------------------ a step
    def proposes(self, so: SchedulerOutput) -> bool:
        """Whether this step runs the proposer before the target's forward."""
        return bool(so.drafter_feeds)

    def capture(self) -> AbstractContextManager[list[mx.array] | None]:
        """Around the target's forward: what the proposer needs of it (MTP: its hidden
        states, worker/mtp.py); a draft model needs nothing."""
        return nullcontext()

    def propose(
        self, so: SchedulerOutput, sampling: Callable[[Request, int], SamplingState]
    ) -> Proposal | None:
        """Feed each followed request its catch-up tokens, then draft for those that verify
        drafts this step (None when none does). ``sampling(request, j)``: the request's
        sampling state for its j-th draft."""
        assert self.kv_cache is not None, "ensure_blocks() comes before the first step"
        followed = [r for r in so.scheduled_requests if r.request_id in so.drafter_feeds]
        # Decode-shaped rows (one token) first, as AttentionMetadata wants.
        followed.sort(key=lambda r: _feed_len(so, r) != 1)
        ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, tables = [], [], []
        last_row: dict[str, int] = {}  # requests that draft: the row that predicts d0
        for req in followed:
            start, end = so.drafter_feeds[req.request_id]
            ids += req.get_token_ids(start, end)
            positions += range(start, end)
            query_lens.append(end - start)
            context_lens.append(end)
            tables.append(so.block_ids[req.request_id][0])
            if so.draft_token_ids.get(req.request_id):
                assert end == req.num_tokens, (req, start, end)
                last_row[req.request_id] = len(ids) - 1
        # The target's batch order (not the sort above): the proposal follows it.
        drafting = [r for r in so.scheduled_requests if r.request_id in last_row]
        last_rows = [last_row[r.request_id] for r in drafting]
        logits = self._forward(ids, positions, query_lens, context_lens, tables, last_rows)
        if not drafting:
            return None
        tables = [so.block_ids[r.request_id][0] for r in drafting]

        def next_pass(rows: list[int], j: int, fed: mx.array) -> mx.array:
            # Draft j + 1's input is draft j, at the position after the last token + j.
            ctx = [drafting[i].num_tokens + j + 1 for i in rows]
            positions = [c - 1 for c in ctx]
            picked = [tables[i] for i in rows]
            return self._forward(
                fed, positions, [1] * len(rows), ctx, picked, list(range(len(rows)))
            )

        return draft_passes(so, drafting, sampling, self.vocab_size, logits, next_pass)

    def _forward(
        self,
        input_ids: list[int] | mx.array,
        positions: list[int],
        query_lens: list[int],
        context_lens: list[int],
        tables: list[list[int]],
        logits_rows: list[int],
    ) -> mx.array:  # (len(logits_rows), vocab) of the draft model
        md = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size)
        if not isinstance(input_ids, mx.array):
            input_ids = mx.array(input_ids, dtype=mx.int32)
        return self.model(
            input_ids,
            mx.array(positions, dtype=mx.int32),
            md,
            self.kv_cache,
            logits_indices=mx.array(logits_rows or [0], dtype=mx.int32),
            **self._extra(md),
        )


def _feed_len(so: SchedulerOutput, request: Request) -> int:
    start, end = so.drafter_feeds[request.request_id]
    return end - start


def draft_passes(
    so: SchedulerOutput,
    drafting: list[Request],
    sampling: Callable[[Request, int], SamplingState],
    vocab_size: int,
    logits: mx.array,  # (len(drafting), vocab): what predicts each request's first draft
    next_pass: Callable[[list[int], int, mx.array], mx.array],
) -> Proposal:
    """Sample the drafts pass by pass: pass j drafts the j-th token of the requests with
    more than j drafts; ``next_pass(rows, j, tokens)`` gives the logits of pass j + 1 for
    ``rows`` (indices into ``drafting``) fed their pass-j ``tokens``. The draft model and
    the MTP layer differ only there."""
    num_drafts = [len(so.draft_token_ids[r.request_id]) for r in drafting]
    rows = list(range(len(drafting)))  # which drafting requests the logits are for
    drafted: list[list[mx.array]] = [[] for _ in drafting]
    # q of each draft, when any request samples (a greedy request's rows: zeros, unread).
    any_sampled = any(not r.sampling_params.is_greedy for r in drafting)
    q_rows: list[list[mx.array]] = [[] for _ in drafting]
    for j in range(max(num_drafts)):
        states = [sampling(drafting[i], j) for i in rows]
        batch = make_sampling_batch(states, vocab_size)
        tokens, probs = sample_draft(logits, batch, vocab_size)
        for n, i in enumerate(rows):
            drafted[i].append(tokens[n : n + 1])
            if any_sampled:
                q = mx.zeros((1, vocab_size)) if probs is None else probs[n : n + 1]
                q_rows[i].append(q)
        keep = [n for n, i in enumerate(rows) if num_drafts[i] > j + 1]
        if not keep:
            break
        rows = [rows[n] for n in keep]
        logits = next_pass(rows, j, tokens[mx.array(keep, dtype=mx.int32)])
    token_ids = mx.concatenate([t for per in drafted for t in per])
    probs = mx.concatenate([q for per in q_rows for q in per]) if any_sampled else None
    return Proposal(token_ids, probs)


def sample_draft(
    logits: mx.array,  # (N, draft vocab)
    batch: SamplingBatch,
    target_vocab: int,
) -> tuple[mx.array, mx.array | None]:  # (N,) int32, (N, target_vocab) float32 or None
    """Each row's draft token, drawn as the request samples (greedy: the argmax), and the
    distribution q it was drawn from (None when every row is greedy). The draft's logits
    are cut or padded (-inf) to the target's width: same tokenizer, embeddings padded
    differently."""
    draft_vocab = logits.shape[-1]
    raw = logits.astype(mx.float32)
    if draft_vocab > target_vocab:
        raw = raw[:, :target_vocab]
    elif draft_vocab < target_vocab:
        pad = mx.full((raw.shape[0], target_vocab - draft_vocab), -mx.inf)
        raw = mx.concatenate([raw, pad], axis=-1)
    processed = apply_logits_processors(raw, batch)
    greedy = mx.argmax(processed, axis=-1).astype(mx.int32)
    if batch.all_greedy:
        return greedy, None
    filtered = filter_logits(processed, batch)
    keys = [None if k is None else (k ^ _DRAFT_TAG) & _SEED_MASK for k in batch.keys]
    noise = gumbel_rows(keys, target_vocab)  # (N, V): the draft's own noise
    sampled = mx.argmax(filtered + noise, axis=-1).astype(mx.int32)
    tokens = mx.where(batch.temperature > 0, sampled, greedy)
    return tokens, mx.softmax(filtered, axis=-1)


def check_same_tokenizer(target, draft, draft_name: str) -> None:
    """ValueError (naming speculative_config.model) unless the draft model's tokenizer is
    the target's: vocabulary size, the ids of a probe text, the special tokens."""
    problems = []
    if target.vocab_size != draft.vocab_size:
        problems.append(f"vocabulary size {draft.vocab_size} vs {target.vocab_size}")
    want, got = target.encode(PROBE_TEXT), draft.encode(PROBE_TEXT)
    if want != got:
        pairs = zip(want, got, strict=False)
        at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(want), len(got)))
        problems.append(
            f"the probe text encodes differently (from token {at}: "
            f"{got[at : at + 4]} vs {want[at : at + 4]})"
        )
    if target.eos_token_ids != draft.eos_token_ids:
        problems.append(f"eos ids {sorted(draft.eos_token_ids)} vs {sorted(target.eos_token_ids)}")
    if target.bos_token_id != draft.bos_token_id:
        problems.append(f"bos id {draft.bos_token_id} vs {target.bos_token_id}")
    if target.special_tokens != draft.special_tokens:
        problems.append("special tokens differ")
    if problems:
        from mlxserve.exceptions import ParameterError

        raise ParameterError(
            f"speculative_config.model {draft_name!r} does not share the target model's "
            f"tokenizer: {'; '.join(problems)}. A draft model must use the same tokenizer",
            parameter="speculative_config.model",
        )


def check_draft_layout(drafter: Drafter, target: KVCacheLayout, name: str) -> None:
    """ValueError unless both models keep plain full-attention KV the drafter can share
    block tables on (group 0 of the target, one full-attention group of the draft)."""
    from mlxserve.exceptions import ParameterError

    d = drafter.layout
    if d.has_state or d.num_groups != 1 or d.groups[0].kind != FULL_ATTENTION:
        raise ParameterError(
            f"speculative_config.model {name!r}: a draft model must have full attention in "
            f"every layer (it has: {d.describe()})",
            parameter="speculative_config.model",
        )
    if not target.groups or target.groups[0].kind != FULL_ATTENTION:
        raise ParameterError(
            "a draft model needs a target model whose first KV cache group is full "
            f"attention (the target has: {target.describe()})",
            parameter="speculative_config.model",
        )


def load_drafter(config, target_tokenizer, runner) -> Drafter:
    """Load ``config.speculative_config.model`` and check it can draft for the runner's
    model; logs what it costs."""
    from mlxserve.loader import load_model

    name = config.speculative_config.model
    loaded = load_model(name, dtype=config.dtype, revision=None)
    if target_tokenizer is not None and loaded.tokenizer is not None:
        check_same_tokenizer(target_tokenizer, loaded.tokenizer, name)
    # Its pool has the target's K/V dtype (--kv-cache-dtype int8: 8-bit rows too).
    drafter = Drafter(
        loaded.model,
        dtype=runner.kv_dtype,
        block_size=runner.block_size,
        vocab_size=runner.vocab_size,
    )
    check_draft_layout(drafter, runner.layout, name)
    logger.info(
        "draft model %s: %d layers, %.0f MiB of weights, %d KiB of KV per block",
        loaded.source.name,
        drafter.model.num_layers,
        drafter.weights_bytes / 2**20,
        drafter.layout.bytes_per_block(runner.block_size, runner.kv_dtype) // 1024,
    )
    return drafter
