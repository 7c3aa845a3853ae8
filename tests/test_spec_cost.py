"""The cost-aware speculation back-off (core/spec_cost.py), driven by made-up step costs.

Oracle: decision sequences derived by hand from the documented rule (speculate while
seconds per emitted token with drafts < without; probe the other mode for PROBE_STEPS
steps after probe_interval steps, FIRST_PROBE while the other mode is unmeasured, the
interval doubling when a probe confirms).
"""

from __future__ import annotations

from mlxserve.core.spec_cost import (
    FIRST_PROBE,
    MAX_PROBE_INTERVAL,
    MIN_STEPS,
    PROBE_INTERVAL,
    PROBE_STEPS,
    CostBackoff,
    batch_bucket,
    context_bucket,
)


def run(backoff: CostBackoff, steps: int, cost, batch: int = 1, context: int = 0) -> list[bool]:
    """Run ``steps`` steps; ``cost(i, speculated) -> (seconds, tokens)``; the decisions."""
    decisions = []
    for i in range(steps):
        spec = backoff.should_speculate(batch, context)
        decisions.append(spec)
        seconds, tokens = cost(i, spec)
        backoff.observe(batch, spec, seconds, tokens, context)
    return decisions


def runs(decisions: list[bool]) -> list[tuple[bool, int]]:
    """The decisions as (value, run length) pairs."""
    out: list[tuple[bool, int]] = []
    for d in decisions:
        if out and out[-1][0] == d:
            out[-1] = (d, out[-1][1] + 1)
        else:
            out.append((d, 1))
    return out


def losing(i: int, spec: bool) -> tuple[float, int]:
    # With drafts: 0.3 s for 2 tokens (0.15 s/token); without: 0.1 s for 1 token.
    return (0.3, 2) if spec else (0.1, 1)


def winning(i: int, spec: bool) -> tuple[float, int]:
    # With drafts: 0.15 s for 3 tokens (0.05 s/token); without: 0.1 s for 1 token.
    return (0.15, 3) if spec else (0.1, 1)


def test_speculation_that_loses_turns_off_and_is_probed_ever_less_often() -> None:
    b = CostBackoff()
    decisions = run(b, FIRST_PROBE + PROBE_STEPS + 32 + 4 + 64 + 4 + 10, losing)
    # On from the start; no plain step yet, so nothing to compare until the first plain
    # probe, which shows plain is cheaper: off. Then spec probes after 32, 64 plain steps.
    assert runs(decisions) == [
        (True, FIRST_PROBE),
        (False, PROBE_STEPS + 32),  # the plain probe, which decides "off"; 32 plain steps
        (True, PROBE_STEPS),  # a spec probe: confirms "off", the interval doubles
        (False, 64),
        (True, PROBE_STEPS),
        (False, 10),
    ]
    assert not b.is_on(1) and b.num_switches == 1
    assert b.state(1).probe_interval == 128


def test_speculation_that_wins_stays_on() -> None:
    b = CostBackoff()
    decisions = run(b, 200, winning)
    # Plain probes only (4 steps after 8, then 64 speculating steps), never switched.
    assert runs(decisions) == [
        (True, FIRST_PROBE),
        (False, PROBE_STEPS),
        (True, 64),
        (False, PROBE_STEPS),
        (True, 120),
    ]
    assert b.is_on(1) and b.num_switches == 0


def test_switches_back_on_when_speculation_starts_to_pay() -> None:
    b = CostBackoff()
    run(b, 40, losing)
    assert not b.is_on(1)
    # Drafts become cheap (say the context got short): the next spec probe sees it.
    decisions = run(b, 40, winning)
    assert b.is_on(1) and b.num_switches == 2
    first_probe = decisions.index(True)
    assert decisions[first_probe : first_probe + PROBE_STEPS] == [True] * PROBE_STEPS
    # The averages move towards the new costs within the probe, and it stays on.
    assert all(decisions[first_probe:])


def test_turns_off_as_soon_as_speculating_costs_more_than_plain() -> None:
    b = CostBackoff()
    run(b, 40, winning)  # both modes measured, on
    assert b.is_on(1)
    decisions = run(b, 10, lambda i, spec: (0.5, 2) if spec else (0.1, 1))
    # Each speculating step folds a quarter of the new cost in: after two steps the
    # averages give 0.303 s / 2.56 tokens = 0.118 s per token > 0.1 without drafts.
    assert decisions[:2] == [True, True] and not any(decisions[2:])
    assert not b.is_on(1)


def test_batch_sizes_are_decided_apart() -> None:
    b = CostBackoff()
    run(b, 40, losing, batch=1)
    run(b, 40, winning, batch=5)
    assert not b.is_on(1)
    assert b.is_on(4) and b.is_on(7)  # the 4-7 bucket
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 7, 8, 32)] == [1, 2, 2, 3, 3, 4, 6]


def test_steps_without_tokens_teach_nothing() -> None:
    b = CostBackoff()
    for _ in range(3 * PROBE_INTERVAL):
        b.observe(1, False, 5.0, 0)
        b.observe(1, True, 5.0, 0)
    s = b.state(1)
    assert s.plain.num_steps == s.spec.num_steps == 0 and s.steps_in_mode == 0
    assert MIN_STEPS <= PROBE_STEPS and PROBE_INTERVAL < MAX_PROBE_INTERVAL


def test_context_lengths_are_decided_apart() -> None:
    """Drafts over a long context cost more (each verified row attends to all of it):
    speculation off at 1,500 tokens says nothing about a short chat."""
    b = CostBackoff()
    long_run = run(b, 40, losing, context=1500)
    assert long_run[-1] is False and not b.is_on(1, 1500) and not b.is_on(1, 2047)
    assert b.is_on(1, 100) and b.is_on(1, 511) and b.is_on(1, 2048)
    assert [context_bucket(n) for n in (0, 511, 512, 1023, 1024, 2048)] == [0, 0, 1, 1, 2, 3]


def test_back_on_only_when_clearly_cheaper() -> None:
    """Off, drafts must be 10% cheaper per token to come back: 5% is noise."""
    b = CostBackoff()
    run(b, 40, losing)
    assert not b.is_on(1)
    run(b, 200, lambda i, spec: (0.19, 2) if spec else (0.1, 1))  # 0.095 s/token: 5% less
    assert not b.is_on(1) and b.num_switches == 1
    run(b, 200, lambda i, spec: (0.17, 2) if spec else (0.1, 1))  # 0.085 s/token: 15% less
    assert b.is_on(1) and b.num_switches == 2
