"""Batched sampling with per-request parameters, one row per sampling request.

    raw logits --(logits processors: bias, penalties, min_tokens)--> processed
    processed --(temperature, top-k, top-p, min-p)--> filtered
    filtered --(argmax, or argmax + per-request Gumbel noise)--> token ids
    raw logits --(log_softmax)--> logprobs of the chosen token and the top-k

Logprobs describe the model's own distribution (raw logits), as OpenAI's do.
Each request draws its noise from a key made of its own seed and its output length,
so a seeded request samples the same tokens alone or inside any batch.

Speculative decoding: a row may carry a draft token x (the token the proposer guessed for
that position). The row then also says whether x is accepted, and its token is what
replaces x when it is not (rejection sampling for a deterministic draft):

    greedy:   accept x iff x == argmax;                 else the argmax
    sampled:  accept x with probability p(x) (u < p(x)); else a sample of p with x removed
              and renormalised (the Gumbel argmax with x masked)

so the token at that position is distributed as p exactly: p(x) + (1 - p(x)) * 0 for x,
(1 - p(x)) * p(y) / (1 - p(x)) = p(y) for any other y. The uniform u comes from a key of its
own (the row's key with a tag), independent of the Gumbel noise.

A draft drawn from a distribution q (a draft model's) comes with q; then (Leviathan et al.)

    sampled:  accept x when u < p(x) / q(x); else a sample of max(p - q, 0), renormalised

P(y) = q(y) min(1, p(y)/q(y)) + (1 - sum min(p, q)) (p(y) - q(y))+ / sum (p - q)+ = p(y),
since sum (p - q)+ = 1 - sum min(p, q). A deterministic draft is the case q = one-hot(x).
Greedy rows accept x iff it is the argmax, whatever q.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import mlx.core as mx
import numpy as np

from mlxserve.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1
_ACCEPT_TAG = 0x5DEECE66D  # mixed into a row's key for its acceptance uniform


@dataclass
class SamplingState:
    """Per-request host state the sampler needs across steps."""

    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_counts: dict[int, int] = field(default_factory=dict)
    num_output_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()  # eos + stop_token_ids, masked until min_tokens

    @cached_property
    def prompt_token_set(self) -> frozenset[int]:
        """The prompt's distinct token ids, computed once (the repetition penalty's)."""
        return frozenset(self.prompt_token_ids)

    def append(self, token_id: int) -> None:
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
        self.num_output_tokens += 1

    def ahead(self, num_tokens: int) -> SamplingState:
        """This state as it will be ``num_tokens`` outputs later, for a draft's row or a
        decode scheduled while its previous token is in flight (async scheduling): its
        noise key and min_tokens masking move on; token counts do not (requests with
        penalties neither speculate nor are scheduled ahead)."""
        if not num_tokens:
            return self
        return replace(self, num_output_tokens=self.num_output_tokens + num_tokens)


@dataclass
class SamplingBatch:
    """Device arrays and host flags for one step's sampling rows."""

    temperature: mx.array  # (N,) float32; 0 = greedy
    top_k: mx.array | None  # (N,) int32, vocab_size = off; None when no row uses it
    top_p: mx.array | None  # (N,) float32
    min_p: mx.array | None  # (N,) float32
    keys: list[int | None]  # per-row noise seed; None for greedy rows
    bias_rows: mx.array | None  # sparse additive adjustments: (M,) rows, cols, values
    bias_cols: mx.array | None
    bias_values: mx.array | None
    penalty: tuple[mx.array, ...] | None  # (rows, cols, counts, in_prompt, rep, pres, freq)
    num_logprobs: int  # max top-k logprobs asked by any row
    want_logprobs: bool  # any row asked for logprobs (0 = only the chosen token's)
    all_greedy: bool
    # Structured outputs: (N, ceil(V / 32)) int32, bit t % 32 of word t // 32 set when
    # token t is allowed; every bit set in rows without a grammar. None: no row has one.
    bitmask: mx.array | None = None


def make_sampling_batch(states: list[SamplingState], vocab_size: int) -> SamplingBatch:
    """Gather per-request parameters into batched arrays (host work, no evaluation)."""
    params = [s.params for s in states]
    temps = [p.temperature if not p.is_greedy else 0.0 for p in params]
    use_top_k = any(0 < p.top_k < vocab_size for p in params if not p.is_greedy)
    use_top_p = any(p.top_p < 1.0 for p in params if not p.is_greedy)
    use_min_p = any(p.min_p > 0.0 for p in params if not p.is_greedy)
    keys = [
        None if t == 0.0 else (s.seed * 1_000_003 + s.num_output_tokens) & _SEED_MASK
        for s, t in zip(states, temps, strict=True)
    ]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    p_rows: list[int] = []
    p_cols: list[int] = []
    p_counts: list[int] = []
    p_in_prompt: list[bool] = []
    p_rep: list[float] = []
    p_pres: list[float] = []
    p_freq: list[float] = []
    for i, (s, p) in enumerate(zip(states, params, strict=True)):
        if p.logit_bias:
            for tok, b in p.logit_bias.items():
                if tok < vocab_size:
                    rows.append(i), cols.append(tok), vals.append(b)
        if s.num_output_tokens < p.min_tokens:
            for tok in s.stop_ids:
                if tok < vocab_size:
                    rows.append(i), cols.append(tok), vals.append(-np.inf)
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            prompt = s.prompt_token_set if p.repetition_penalty != 1.0 else frozenset()
            for tok in prompt.union(s.output_counts):
                p_rows.append(i)
                p_cols.append(tok)
                p_counts.append(s.output_counts.get(tok, 0))
                p_in_prompt.append(tok in prompt)
                p_rep.append(p.repetition_penalty)
                p_pres.append(p.presence_penalty)
                p_freq.append(p.frequency_penalty)
    penalty = None
    if p_rows:
        penalty = (
            mx.array(p_rows, dtype=mx.int32),
            mx.array(p_cols, dtype=mx.int32),
            mx.array(p_counts, dtype=mx.float32),
            mx.array(p_in_prompt),
            mx.array(p_rep, dtype=mx.float32),
            mx.array(p_pres, dtype=mx.float32),
            mx.array(p_freq, dtype=mx.float32),
        )
    return SamplingBatch(
        temperature=mx.array(temps, dtype=mx.float32),
        top_k=mx.array([p.top_k if p.top_k > 0 else vocab_size for p in params], mx.int32)
        if use_top_k
        else None,
        top_p=mx.array([p.top_p for p in params], dtype=mx.float32) if use_top_p else None,
        min_p=mx.array([p.min_p for p in params], dtype=mx.float32) if use_min_p else None,
        keys=keys,
        bias_rows=mx.array(rows, dtype=mx.int32) if rows else None,
        bias_cols=mx.array(cols, dtype=mx.int32) if rows else None,
        bias_values=mx.array(vals, dtype=mx.float32) if rows else None,
        penalty=penalty,
        num_logprobs=max((p.num_logprobs for p in params), default=0),
        want_logprobs=any(p.logprobs is not None for p in params),
        all_greedy=all(t == 0.0 for t in temps),
    )


@dataclass
class SamplerOutput:
    """Lazy results of one sampling step (the runner evaluates them)."""

    token_ids: mx.array  # (N,) int32
    logprobs: mx.array | None  # (N,) float32: logprob of each chosen token
    top_ids: mx.array | None  # (N, k) int32
    top_logprobs: mx.array | None  # (N, k) float32
    accepted: mx.array | None = None  # (N,) bool: the row's draft is accepted (drafts only)


def apply_logits_processors(logits: mx.array, batch: SamplingBatch) -> mx.array:
    """Logit bias, min_tokens masking and repetition/presence/frequency penalties."""
    if batch.penalty is not None:
        rows, cols, counts, in_prompt, rep, pres, freq = batch.penalty
        picked = logits[rows, cols]  # (M,)
        # HF-style repetition penalty on tokens seen anywhere (prompt or output).
        seen = in_prompt | (counts > 0)
        repeated = mx.where(picked > 0, picked / rep, picked * rep)
        new = mx.where(seen, repeated, picked)
        # OpenAI-style presence/frequency penalties on output tokens only.
        new = new - pres * (counts > 0) - freq * counts
        # .at[].add returns a new array: the caller's raw logits stay untouched.
        logits = logits.at[rows, cols].add(new - picked)
    if batch.bias_rows is not None:
        logits = logits.at[batch.bias_rows, batch.bias_cols].add(batch.bias_values)
    return logits


def apply_bitmask(logits: mx.array, bitmask: mx.array) -> mx.array:
    """-inf where a row's bitmask does not allow the token; allowed logits unchanged."""
    token = mx.arange(logits.shape[-1], dtype=mx.int32)  # (V,)
    words = bitmask[:, token // 32]  # (N, V) the word holding each token's bit
    allowed = mx.right_shift(words, token % 32) & 1  # (N, V)
    return mx.where(allowed.astype(mx.bool_), logits, -mx.inf)


def filter_logits(logits: mx.array, batch: SamplingBatch) -> mx.array:
    """Temperature, then top-k / top-p / min-p masking (rows that do not ask are untouched)."""
    temp = mx.where(batch.temperature > 0, batch.temperature, 1.0)
    logits = logits / temp[:, None]
    if batch.top_k is not None or batch.top_p is not None:
        order = mx.argsort(-logits, axis=-1)  # (N, V) descending
        ranked = mx.take_along_axis(logits, order, axis=-1)
        drop = mx.zeros(ranked.shape, dtype=mx.bool_)
        if batch.top_k is not None:
            drop = drop | (mx.arange(ranked.shape[-1])[None, :] >= batch.top_k[:, None])
        if batch.top_p is not None:
            probs = mx.softmax(mx.where(drop, -mx.inf, ranked), axis=-1)
            mass_before = mx.cumsum(probs, axis=-1) - probs
            drop = drop | (mass_before >= batch.top_p[:, None])
        drop = mx.put_along_axis(mx.zeros(drop.shape, dtype=mx.bool_), order, drop, axis=-1)
        logits = mx.where(drop, -mx.inf, logits)
    if batch.min_p is not None:
        probs = mx.softmax(logits, axis=-1)
        threshold = batch.min_p[:, None] * probs.max(axis=-1, keepdims=True)
        logits = mx.where(probs < threshold, -mx.inf, logits)
    return logits


def gumbel_rows(keys: list[int | None], vocab: int) -> mx.array:  # (N, vocab) float32
    """Gumbel noise for each row from its own key (zeros for a greedy row's None): a row's
    draw depends on its key only, never on the batch it shares."""
    return mx.stack(
        [
            mx.zeros((vocab,)) if k is None else mx.random.gumbel((vocab,), key=mx.random.key(k))
            for k in keys
        ]
    )


def sample(
    logits: mx.array,
    batch: SamplingBatch,
    draft_ids: mx.array | None = None,
    draft_probs: mx.array | None = None,
) -> SamplerOutput:
    """Pick one token per row of ``logits`` (N, V); with ``draft_ids`` (N,) int32 (-1: no
    draft), also verify each row's draft (``SamplerOutput.accepted``), drawn from
    ``draft_probs`` (N, V) when given, else deterministic. Logprobs are those of each
    row's resulting token: its draft when accepted."""
    raw = logits.astype(mx.float32)
    processed = apply_logits_processors(raw, batch)
    if batch.bitmask is not None:
        processed = apply_bitmask(processed, batch.bitmask)
    greedy = mx.argmax(processed, axis=-1)
    accepted = None
    if draft_ids is not None:
        accepted = (draft_ids >= 0) & (greedy == draft_ids)  # (N,) greedy rows' verdict
    if batch.all_greedy:
        token_ids = greedy
    else:
        vocab = processed.shape[-1]
        noise = gumbel_rows(batch.keys, vocab)  # (N, V)
        filtered = filter_logits(processed, batch)
        if draft_ids is not None:
            has_draft = draft_ids >= 0
            is_draft = mx.arange(vocab)[None, :] == draft_ids[:, None]  # (N, V)
            probs = mx.softmax(filtered, axis=-1)  # (N, V) the target distribution p
            p_draft = mx.sum(mx.where(is_draft, probs, 0.0), axis=-1)  # (N,) p(x)
            uniform = mx.stack(
                [
                    mx.zeros(())
                    if k is None
                    else mx.random.uniform(shape=(), key=mx.random.key(k ^ _ACCEPT_TAG))
                    for k in batch.keys
                ]
            )  # (N,)
            if draft_probs is None:
                sampled_accept = has_draft & (uniform < p_draft)
                # A rejected draft is replaced by a sample of p without it.
                filtered = mx.where(is_draft & has_draft[:, None], -mx.inf, filtered)
            else:
                q_draft = mx.sum(mx.where(is_draft, draft_probs, 0.0), axis=-1)  # (N,) q(x)
                sampled_accept = has_draft & (uniform * q_draft < p_draft)
                residual = mx.maximum(probs - draft_probs, 0.0)  # (N, V)
                # p == q to rounding leaves no residual: then p itself (a rejection is
                # as rare as the rounding).
                usable = has_draft & (mx.sum(residual, axis=-1) > 0)
                filtered = mx.where(usable[:, None], mx.log(residual), filtered)
            accepted = mx.where(batch.temperature > 0, sampled_accept, accepted)
        sampled = mx.argmax(filtered + noise, axis=-1)
        token_ids = mx.where(batch.temperature > 0, sampled, greedy)
    token_ids = token_ids.astype(mx.int32)
    if not batch.want_logprobs:
        return SamplerOutput(token_ids, None, None, None, accepted)
    logprobs = raw - mx.logsumexp(raw, axis=-1, keepdims=True)  # (N, V)
    result = token_ids if accepted is None else mx.where(accepted, draft_ids, token_ids)
    chosen = mx.take_along_axis(logprobs, result[:, None], axis=-1)[:, 0]
    top_ids = top_lp = None
    if batch.num_logprobs:
        top_ids, top_lp = top_logprobs(logprobs, batch.num_logprobs)
    return SamplerOutput(token_ids, chosen, top_ids, top_lp, accepted)


def top_logprobs(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k most likely tokens of each row, best first: (ids (N, k), logprobs (N, k))."""
    k = min(k, logprobs.shape[-1])
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1).astype(mx.int32), mx.take_along_axis(
        vals, order, axis=-1
    )


def prompt_logprobs(
    logits: mx.array, target_ids: list[int], k: int
) -> tuple[mx.array, ...]:  # (R,), then (R, k) ids and (R, k) logprobs when k > 0
    """Logprob of each row's target token (the next prompt token), and the row's top k."""
    raw = logits.astype(mx.float32)
    logprobs = raw - mx.logsumexp(raw, axis=-1, keepdims=True)  # (R, V)
    targets = mx.array(target_ids, dtype=mx.int32)
    chosen = mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
    if k == 0:
        return (chosen,)
    return (chosen, *top_logprobs(logprobs, k))
