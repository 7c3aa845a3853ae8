"""What n-gram speculation would do with other settings, replayed from a greedy output.

Greedy verification keeps a draft exactly when it is the token the model emits next, so
given the prompt and the plain (greedy) output, the steps, drafts and accepted tokens of
any ``num_speculative_tokens`` / ``prompt_lookup_min`` / ``prompt_lookup_max`` follow
without running the model: the scheduler's proposer (core/ngram_proposer.py) is run on the
same tokens, bounded as the scheduler bounds it (never past max_tokens), with the
per-request acceptance back-off (core/spec_decode.py: a request whose recent drafts were
accepted less than ``min_acceptance_rate`` pauses for PAUSE_TOKENS). Not replayed: the
cost back-off (it depends on measured step times) and the batch-size one (one stream).

With a step's cost as a function of its rows (1 + drafts), from bench/decode_profile.py
--verify-rows at the same context, the replay predicts the speed-up over plain decoding.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from mlxserve.core.ngram_proposer import NgramProposer
from mlxserve.core.spec_decode import PAUSE_TOKENS


def replay(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    k: int,
    lookup_min: int = 2,
    lookup_max: int = 4,
    max_tokens: int | None = None,
    min_acceptance_rate: float = 0.2,
) -> dict:
    """Steps, drafted and accepted tokens, and rows per step of n-gram speculation that
    emits ``output_ids`` after ``prompt_ids`` (greedy)."""
    proposer = NgramProposer(lookup_min, lookup_max)
    max_tokens = len(output_ids) if max_tokens is None else max_tokens
    tokens = list(prompt_ids) + [output_ids[0]]  # the prefill step emits the first token
    done, steps, drafted, accepted = 1, 1, 0, 0
    acceptance, paused_until = 1.0, 0
    rows: Counter[int] = Counter({1: 1})
    while done < len(output_ids):
        room = max_tokens - done - 1
        drafts: list[int] = []
        if room >= 1 and done >= paused_until:
            drafts = proposer.propose(tokens, min(k, room))
        n = 0
        while n < len(drafts) and done + n < len(output_ids) and drafts[n] == output_ids[done + n]:
            n += 1
        emitted = min(n + 1, len(output_ids) - done)
        tokens += output_ids[done : done + emitted]
        done += emitted
        steps += 1
        rows[1 + len(drafts)] += 1
        if drafts:
            drafted += len(drafts)
            accepted += n
            acceptance = 0.5 * acceptance + 0.5 * n / len(drafts)
            if acceptance < min_acceptance_rate:
                paused_until, acceptance = done + PAUSE_TOKENS, 1.0
    return {"steps": steps, "drafted": drafted, "accepted": accepted, "rows": dict(rows)}


def predicted_speedup(result: dict, num_tokens: int, row_cost: dict[int, float]) -> float | None:
    """Plain decoding's steps over the replay's cost, a step of r rows costing
    ``row_cost[r]`` plain steps (linear between measured row counts; None if a row count
    lies outside them)."""
    known = sorted(row_cost)
    total = 0.0
    for rows, count in result["rows"].items():
        r = int(rows)  # an int key, or its string from a JSON file
        if r in row_cost:
            total += count * row_cost[r]
            continue
        lo = max((x for x in known if x < r), default=None)
        hi = min((x for x in known if x > r), default=None)
        if lo is None or hi is None:
            return None
        total += count * (row_cost[lo] + (row_cost[hi] - row_cost[lo]) * (r - lo) / (hi - lo))
    return num_tokens / total
