"""Pipeline parallelism for the hand-written decoders (llama, mistral, qwen2, qwen3).

Each rank holds a contiguous range of layers (and only their weights and KV pool)::

    rank 0:  embed -> layers [0, a)  --send h-->  rank 1: layers [a, b) --send h--> ...
    last:    layers [y, L) -> norm -> LM head on the needed rows --all_sum--> every rank

Rank 0 samples, so the logits of the rows it needs come back to it; they travel as an
``all_sum`` in which every other rank adds zeros (exact), because a ``recv`` has no
inputs and so no place in the evaluation order of rank 0's lazy step: its zeros depend
on rank 0's last send, so it can only run after it.

A step's requests are split into micro-batches (contiguous, balanced by tokens, one per
stage) that flow through the stages in order, so rank 0 computes micro-batch k+1 while
rank 1 computes micro-batch k (P stages, M micro-batches: a forward idles (P-1)/(M+P-1))::

    rank 0 | mb0 | mb1 |  wait  |         rank 1 |     | mb0 | mb1 | head |

Only when each micro-batch gets ``micro_batch_tokens`` tokens or more: each micro-batch
reads the stage's weights again, which a decode step (bandwidth-bound) pays in full and
a prefill chunk (compute-bound) hardly notices.

Layers are split to balance the bytes each rank reads per token (layers, plus the LM
head on the last rank; an embedding lookup reads one row), which is what a decode step
costs on Apple silicon. A tied LM head keeps the embedding on the last rank too.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxserve.exceptions import ParameterError
from mlxserve.models import llama
from mlxserve.models.base import KVCache, select_rows, split_hidden_rows
from mlxserve.models.tensor_parallel import require_llama
from mlxserve.ops import AttentionMetadata

__all__ = [
    "PipelineStage",
    "check_pipeline_parallel",
    "micro_batch_metadata",
    "micro_batches",
    "stage_ranges",
]


def _bytes(module: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def check_pipeline_parallel(model: nn.Module, size: int) -> None:
    """ParameterError (field pipeline_parallel_size) if ``model`` cannot be split ``size`` ways."""
    require_llama(model, "pipeline_parallel_size", size)
    num_layers = len(model.model.layers)
    if size > num_layers:
        raise ParameterError(
            f"pipeline_parallel_size {size} is more than this model's {num_layers} layers: "
            "each rank needs at least one",
            parameter="pipeline_parallel_size",
        )


def stage_ranges(layer_costs: list[int], head_cost: int, size: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per rank, minimising the largest rank's cost (the last
    rank also pays ``head_cost``); every range holds at least one layer."""
    n = len(layer_costs)
    assert 1 <= size <= n, (size, n)
    prefix = [0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the smallest max cost splitting layers [0, i) over k ranks; cut: its last cut.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(size + 1)]
    cut = [[0] * (n + 1) for _ in range(size + 1)]
    best[0][0] = 0
    for k in range(1, size + 1):
        for i in range(k, n + 1):
            extra = head_cost if (k == size and i == n) else 0
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    ranges, i = [], n
    for k in range(size, 0, -1):
        ranges.append((cut[k][i], i))
        i = cut[k][i]
    return ranges[::-1]


def micro_batches(
    query_lens: tuple[int, ...], max_micro_batches: int, min_tokens: int = 1
) -> list[tuple[int, int]]:
    """Split a step's requests (in batch order) into contiguous ranges ``[a, b)`` of about
    equal token counts, none empty: at most ``max_micro_batches``, and no more than give
    each about ``min_tokens`` tokens."""
    num_reqs = len(query_lens)
    total = sum(query_lens)
    m = max(1, min(max_micro_batches, num_reqs, total // min_tokens))
    out, a, seen = [], 0, 0
    for i, q in enumerate(query_lens):
        seen += q
        left_reqs = num_reqs - i - 1
        left_batches = m - len(out) - 1
        # Cut once this range holds its share, keeping a request for each later range.
        if left_batches and (seen * m >= total * (len(out) + 1) or left_reqs == left_batches):
            out.append((a, i + 1))
            a = i + 1
    out.append((a, num_reqs))
    return out


def micro_batch_metadata(
    md: AttentionMetadata, a: int, b: int
) -> tuple[AttentionMetadata, int, int]:
    """Requests ``[a, b)`` of a step's metadata, and their tokens' range ``[t0, t1)``.

    Slices of the step's own arrays: the block tables keep the step's width, so each
    request's attention reads exactly what it reads in the whole step.
    """
    if (a, b) == (0, md.num_reqs):
        t1 = sum(md.query_lens)
        return md, 0, t1
    t0 = sum(md.query_lens[:a])
    query_lens = md.query_lens[a:b]
    t1 = t0 + sum(query_lens)
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    sub = AttentionMetadata(
        slot_mapping=md.slot_mapping[t0:t1],
        query_start_loc=md.query_start_loc[a : b + 1] - t0,
        context_lens=md.context_lens[a:b],
        block_tables=md.block_tables[a:b],
        num_decodes=num_decodes,
        query_lens=query_lens,
        context_lens_host=md.context_lens_host[a:b],
    )
    return sub, t0, t1


class PipelineStage(nn.Module):
    """This rank's share of a llama-family model; called like the model on rank 0."""

    def __init__(
        self, model: llama.Model, group: mx.distributed.Group, micro_batch_tokens: int = 64
    ) -> None:
        super().__init__()
        size = group.size()
        check_pipeline_parallel(model, size)
        args = model.args
        self.args = args
        self.rank, self.size = group.rank(), size
        self.is_first, self.is_last = self.rank == 0, self.rank == size - 1
        stack = model.model
        tied = args.tie_word_embeddings
        head = stack.embed_tokens if tied else model.lm_head
        ranges = stage_ranges([_bytes(layer) for layer in stack.layers], _bytes(head), size)
        self.layer_ranges = ranges
        lo, hi = ranges[self.rank]
        # What crosses ranks: hidden states between stages, logits back to rank 0
        # (dtypes as one process computes them; a lookup and one row through the head).
        h = stack.embed_tokens(mx.zeros((1,), dtype=mx.int32))
        self.hidden_size = args.hidden_size
        self.hidden_dtype = h.dtype
        self.logits_dtype = (head.as_linear(h) if tied else head(h)).dtype
        self.layers = stack.layers[lo:hi]
        for i, layer in enumerate(self.layers):
            layer.self_attn.layer_idx = i  # this rank's KV pool holds its layers only
        if self.is_first or (self.is_last and tied):
            self.embed_tokens = stack.embed_tokens
        if self.is_last:
            self.norm = stack.norm
            if not tied:
                self.lm_head = model.lm_head
        # What the runner reads from a model.
        self.num_layers = hi - lo
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
        self.vocab_size = model.vocab_size
        self.max_position_embeddings = model.max_position_embeddings
        self.micro_batch_tokens = micro_batch_tokens  # at least, per micro-batch
        self._group = group
        # Rank 0: bytes of hidden states sent and of logits received, as built.
        self.num_bytes_sent = 0
        self.num_bytes_received = 0

    @property
    def pp_group(self) -> mx.distributed.Group:
        """The group the layers are split over."""
        return self._group

    def pool_writes(self, query_lens: list[int]) -> int:
        """How many times a step of ``query_lens`` writes each of this rank's pools: once
        per micro-batch (rank 0 evaluates them in one graph; see ``__call__``)."""
        return len(micro_batches(query_lens, self.size, self.micro_batch_tokens))

    def run_layers(
        self, h: mx.array, positions: mx.array, md: AttentionMetadata, cache: KVCache
    ) -> mx.array:  # (num_tokens, hidden)
        """This rank's layers on one micro-batch's hidden states."""
        for layer in self.layers:
            h = layer(h, positions, md, cache)
        return h

    def head(
        self, h: mx.array, logits_indices: mx.array | None, num_hidden_rows: int
    ) -> tuple[mx.array, mx.array | None]:  # (rows, vocab), (num_hidden_rows, hidden)
        """Last rank: the final norm on the needed rows, the LM head on all but the last
        ``num_hidden_rows`` (those are returned as hidden states)."""
        out = self.norm(select_rows(h, logits_indices))
        out, hidden = split_hidden_rows(out, num_hidden_rows)
        head = self.embed_tokens.as_linear if "lm_head" not in self else self.lm_head
        return head(out), hidden

    def __call__(
        self,
        input_ids: mx.array,  # (num_tokens,) int32
        positions: mx.array,  # (num_tokens,) int32
        attn_metadata: AttentionMetadata,
        kv_cache: KVCache,
        logits_indices: mx.array | None = None,  # (num_rows,) int32
        num_hidden_rows: int = 0,
    ) -> mx.array | tuple[mx.array, mx.array]:
        """The model's outputs (as ``llama.Model``), computed by every stage; every rank
        calls it with the same step (rank 0's input ids are the only ones read).

        Lazy: this rank's micro-batches and sends are tied into its KV pool, so
        evaluating the pool runs them; the outputs arrive when the last rank's head has
        run. A rank r > 0 takes one micro-batch here (its recvs have no inputs, so
        nothing would order two of them in a lazy graph); the engine's ranks r > 0 run
        their steps through :mod:`mlxserve.worker.pipeline` instead, one evaluation at a
        time. Rank 0 and the start-up memory probe (one request) come here.
        """
        md = attn_metadata
        parts = micro_batches(md.query_lens, self.size, self.micro_batch_tokens)
        assert self.is_first or len(parts) == 1, "ranks r > 0: worker/pipeline.py"
        send = None
        outs = []
        for a, b in parts:
            sub, t0, t1 = micro_batch_metadata(md, a, b)
            if self.is_first:
                h = self.embed_tokens(input_ids[t0:t1])  # (tokens, hidden)
            else:
                shape = (t1 - t0, self.hidden_size)
                h = mx.distributed.recv(shape, self.hidden_dtype, self.rank - 1, group=self._group)
            if send is not None:  # after the previous micro-batch is on its way
                h = mx.depends([h], [send])[0]
            h = self.run_layers(h, positions[t0:t1], sub, kv_cache)
            if self.is_last:
                outs.append(h)
            else:
                send = mx.distributed.send(h, self.rank + 1, group=self._group)
                self.num_bytes_sent += h.nbytes
        if send is not None:
            kv_cache.keys[-1] = mx.depends([kv_cache.keys[-1]], [send])[0]
        num_rows = input_ids.shape[0] if logits_indices is None else logits_indices.shape[0]
        shapes = [
            (num_rows - num_hidden_rows, self.vocab_size),
            (num_hidden_rows, self.hidden_size),
        ]
        if self.is_last:
            h = mx.concatenate(outs) if len(outs) > 1 else outs[0]
            logits, hidden = self.head(h, logits_indices, num_hidden_rows)
            if hidden is None:
                hidden = mx.zeros(shapes[1], dtype=self.hidden_dtype)
            arrays = [logits, hidden]
        else:
            dtypes = (self.logits_dtype, self.hidden_dtype)
            arrays = [
                mx.depends([mx.zeros(shape, dtype=dtype)], [send])[0]
                for shape, dtype in zip(shapes, dtypes, strict=True)
            ]
        # Rank 0 gets the last rank's rows; empty ones are not sent (by any rank).
        out = [mx.distributed.all_sum(a, group=self._group) if a.shape[0] else a for a in arrays]
        if self.is_first:
            self.num_bytes_received += sum(a.nbytes for a in arrays)
        return out[0] if not num_hidden_rows else (out[0], out[1])
