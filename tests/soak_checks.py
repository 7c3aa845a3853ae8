"""Checks across the soak's responses, and its figures.

Greedy answers do not depend on the batch they ran in, nor on how they were asked for
(streamed or not, n, logprobs, usage chunk); seeded ones neither (the sampler keys its
noise on the request's seed and output length). On the CPU with int8 activations (the
default) that holds bit for bit by construction, whatever the server's chunking and
prefix-cache hits: the int8 matmul is row-exact and every row's attention is the per-row
primitive (bench/README.md: the soak's two answers, isolated); float activations keep
~1e-5-nat differences across chunkings, which only an exact tie could turn into another
token. So every answer to the same output key
must be the same text with the same finish_reason, and what an aborted stream received
must be a prefix of it. Every response for the same prompt must count the same prompt
tokens, from /tokenize as from the usage of completions and chats.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from tests.soak_client import Outcome

MAX_LISTED = 10  # failures listed per check; the rest are counted


def consistency_failures(outcomes: list[Outcome]) -> list[str]:
    """Disagreements between responses that must agree."""
    answers: dict[tuple, set] = defaultdict(set)  # (output key, sample) -> {(text, finish)}
    partials: list[tuple[tuple, str]] = []
    prompt_counts: dict[tuple, set[int]] = defaultdict(set)
    for o in outcomes:
        call = o.call
        if o.status != "failed" and o.prompt_tokens is not None:
            prompt_counts[call.prompt_key].add(o.prompt_tokens)
        if call.output_key is None or o.status == "failed":
            continue
        greedy = call.body.get("temperature") == 0.0
        for j, text in o.texts.items():
            key = (call.output_key, 0 if greedy else j)  # greedy samples are all alike
            if o.status == "ok":
                answers[key].add((text, o.finish_reasons[j]))
            else:
                partials.append((key, text))
    failures = []
    for key, seen in answers.items():
        if len(seen) > 1:
            failures.append(f"different answers to the same request {key}: {sorted(seen)}")
    for key, text in partials:
        full = answers.get(key)
        if full and len(full) == 1 and not next(iter(full))[0].startswith(text):
            failures.append(f"aborted stream {key} got {text!r}, not a prefix of {full}")
    for key, counts in prompt_counts.items():
        if len(counts) > 1:
            failures.append(f"prompt {key} counted as {sorted(counts)} tokens")
    return _capped(failures)


def _capped(failures: list[str]) -> list[str]:
    if len(failures) <= MAX_LISTED:
        return failures
    return failures[:MAX_LISTED] + [f"... and {len(failures) - MAX_LISTED} more"]


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50 / p90 / p99 / max of values (seconds), or None when there are none."""
    if not values:
        return None
    a = np.asarray(values)
    return {
        "p50": round(float(np.percentile(a, 50)), 3),
        "p90": round(float(np.percentile(a, 90)), 3),
        "p99": round(float(np.percentile(a, 99)), 3),
        "max": round(float(a.max()), 3),
    }


def summarize(outcomes: list[Outcome]) -> dict:
    """Counts, tokens and latencies of one phase's outcomes."""
    status = Counter(o.status for o in outcomes)
    kinds = Counter(f"{o.call.kind}{'-stream' if o.call.stream else ''}" for o in outcomes)
    done = [o for o in outcomes if o.status == "ok" and o.call.kind != "tokenize"]
    return {
        "requests": len(outcomes),
        "ok": status["ok"],
        "aborted": status["aborted"],
        "cut": status["cut"],
        "failed": status["failed"],
        "by_kind": dict(sorted(kinds.items())),
        "n2": sum(o.call.n == 2 for o in outcomes),
        "logprobs": sum(o.call.logprobs for o in outcomes),
        "stop_strings": sum(bool(o.call.stop) for o in outcomes),
        "shared_prefix": sum(bool(o.call.prompt_key and o.call.prompt_key[1]) for o in outcomes),
        "completion_tokens_in_usage": sum(o.completion_tokens or 0 for o in done),
        "latency_s": percentiles([o.latency for o in done]),
        "ttft_s": percentiles([o.ttft for o in done if o.ttft is not None]),
    }


def failure_lines(outcomes: list[Outcome]) -> list[str]:
    """One line per failed call: what was sent, what went wrong."""
    lines = [
        f"{o.call.path} stream={o.call.stream} n={o.call.n} after {o.latency:.1f} s: {o.error}"
        for o in outcomes
        if o.status == "failed"
    ]
    return _capped(lines)
