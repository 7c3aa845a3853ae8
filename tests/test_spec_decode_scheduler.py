"""Speculative decoding in the scheduler, with the fake model (tests/scheduler_harness.py):
drafts scheduled within the budget and the limits, verified, rolled back, backed off.

The fake model verifies drafts greedily against next_token(); outputs are checked against
reference_generate (a plain loop without cache or speculation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlxserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from mlxserve.core.request import Request, RequestStatus
from mlxserve.core.scheduler import Scheduler
from mlxserve.sampling_params import SamplingParams
from tests.scheduler_harness import (
    PagedFakeModel,
    next_token,
    reference_generate,
    run_to_completion,
    step,
)


class Proposer:
    """Drafts from a function of (tokens, k); records every k it was asked for."""

    def __init__(self, fn: Callable[[list[int], int], list[int]]) -> None:
        self.fn = fn
        self.asked: list[int] = []

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        self.asked.append(k)
        return self.fn(list(token_ids), k)


def continuation(tokens: list[int], k: int, wrong_at: int | None = None) -> list[int]:
    """The fake model's next k tokens, the one at ``wrong_at`` changed."""
    seq, out = list(tokens), []
    for i in range(k):
        t = next_token(seq)
        if i == wrong_at:
            t = (t + 1) % 50
        out.append(t)
        seq.append(t)
    return out


def make(
    proposer: Proposer,
    num_blocks: int = 32,
    block_size: int = 4,
    max_model_len: int = 64,
    budget: int = 64,
    **spec: object,
) -> tuple[Scheduler, PagedFakeModel]:
    spec.setdefault("num_speculative_tokens", 4)
    sched = Scheduler(
        SchedulerConfig(max_model_len, 8, budget),
        CacheConfig(num_blocks, block_size, True),
        SpeculativeConfig(**spec),
    )
    sched.spec.proposer = proposer
    return sched, PagedFakeModel(block_size, num_blocks)


def req(rid: str, prompt: list[int], **params: object) -> Request:
    params.setdefault("max_tokens", 16)
    eos = params.pop("eos", frozenset())
    return Request(rid, prompt, SamplingParams(**params), eos_token_ids=eos)


def test_drafts_are_verified_and_rejected_ones_rolled_back() -> None:
    proposer = Proposer(lambda tokens, k: continuation(tokens, k, wrong_at=2))
    sched, model = make(proposer)
    r = req("a", [1, 2, 3, 4, 5])
    sched.add_request(r)
    step(sched, model)  # the prompt: no drafts while prefilling
    assert r.num_output_tokens == 1 and proposer.asked == []
    out = step(sched, model)
    # The last token (position 5) and 4 drafts; drafts 0 and 1 right, draft 2 wrong.
    assert out.start_positions["a"] == 5 and out.num_scheduled_tokens["a"] == 5
    assert len(out.draft_token_ids["a"]) == 4 and out.sampling_request_ids == {"a"}
    assert r.num_output_tokens == 1 + 3  # 2 accepted drafts + the model's token
    assert r.num_computed_tokens == r.num_tokens - 1 == 8
    # Blocks of 4: positions 0..7 computed; the block the drafts reached (8..11) is free.
    assert len(sched.kv_cache_manager.get_block_ids(r)[0]) == 2
    stats = sched.make_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (1, 4)
    assert stats.spec_decode_num_accepted_tokens == 2
    run_to_completion(sched, model)
    assert r.output_token_ids == reference_generate([1, 2, 3, 4, 5], 16, 64)


def test_drafts_stop_at_max_tokens_and_max_model_len() -> None:
    proposer = Proposer(lambda tokens, k: continuation(tokens, k))
    sched, model = make(proposer, max_model_len=12)
    a = req("a", [1, 2, 3], max_tokens=4)
    b = req("b", [7, 8, 9, 10, 11, 12], max_tokens=None)
    sched.add_request(a)
    sched.add_request(b)
    run_to_completion(sched, model)
    # a: 1 token from its prompt, then room for 4 - 1 - 1 = 2 drafts; all accepted
    # (3 tokens): done. b: stops at 12 tokens: 6 prompt + 1, then 12 - 7 - 1 = 4 drafts.
    assert sorted(proposer.asked) == [2, 4]
    assert a.output_token_ids == reference_generate([1, 2, 3], 4, 12)
    assert b.output_token_ids == reference_generate([7, 8, 9, 10, 11, 12], None, 12)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH


def test_drafts_take_the_prefill_share_of_the_budget() -> None:
    proposer = Proposer(lambda tokens, k: continuation(tokens, k, wrong_at=0))
    sched, model = make(proposer, budget=8)
    a = req("a", [1, 2, 3])
    sched.add_request(a)
    step(sched, model)
    sched.add_request(req("b", list(range(10, 30))))
    out = step(sched, model)
    # 1 decode: prefill share max(8 - 1, 4) = 7, of which the drafts take 4.
    assert out.num_scheduled_tokens == {"a": 5, "b": 3}


def test_drafts_are_dropped_when_their_blocks_do_not_fit() -> None:
    proposer = Proposer(lambda tokens, k: continuation(tokens, k))
    # 5 usable blocks of 2: after their prompts a holds 2 blocks and b 3, none left.
    sched, model = make(proposer, num_blocks=6, block_size=2)
    a, b = req("a", [1, 2, 3], max_tokens=3), req("b", [4, 5, 6, 7, 8], max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, model)
    assert sched.kv_cache_manager.get_num_free_blocks() == 0
    out = step(sched, model)  # 1 draft each would need a new block: plain decodes
    assert proposer.asked == [1, 1]
    assert out.draft_token_ids == {} and out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert not out.preempted_request_ids
    run_to_completion(sched, model)
    assert a.output_token_ids == reference_generate([1, 2, 3], 3, 64)
    assert b.output_token_ids == reference_generate([4, 5, 6, 7, 8], 3, 64)


def test_no_drafts_above_the_batch_size_limit() -> None:
    proposer = Proposer(lambda tokens, k: continuation(tokens, k))
    sched, model = make(proposer, disable_by_batch_size=1)
    a, b = req("a", [1, 2, 3], max_tokens=3), req("b", [4, 5, 6], max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, model)
    out = step(sched, model)  # two running: no proposals
    assert out.draft_token_ids == {} and proposer.asked == []
    run_to_completion(sched, model)  # b alone once a is done: it speculates
    assert proposer.asked
    assert b.output_token_ids == reference_generate([4, 5, 6], 12, 64)


def test_a_request_with_poor_acceptance_pauses_proposing() -> None:
    proposer = Proposer(lambda tokens, k: continuation(tokens, k, wrong_at=0))
    sched, model = make(proposer, num_speculative_tokens=2, min_acceptance_rate=0.3)
    r = req("a", [1, 2, 3], max_tokens=30)
    sched.add_request(r)
    run_to_completion(sched, model)
    # Acceptance 1 -> 0.5 -> 0.25 < 0.3: two verifications, then 16 tokens without drafts,
    # then again two: tokens 1, 2, 3 drafted; paused to 19; 19, 20 drafted; paused to 37.
    assert sched.make_stats().spec_decode_num_drafts == 4
    assert r.output_token_ids == reference_generate([1, 2, 3], 30, 64)


def test_a_stop_token_among_accepted_drafts_ends_the_output_there() -> None:
    prompt = [1, 2, 3]
    full = reference_generate(prompt, 8, 64)
    eos = frozenset({full[3]}) - set(full[:3])  # the 4th token stops (first occurrence)
    assert eos
    proposer = Proposer(lambda tokens, k: continuation(tokens, k))
    sched, model = make(proposer)
    r = req("a", prompt, max_tokens=8, eos=eos)
    sched.add_request(r)
    step(sched, model)
    out = sched.schedule()
    ro = model.execute(out)
    assert len(ro.sampled_token_ids["a"]) == 5  # all 4 drafts accepted + 1
    sched.update_from_output(out, ro)
    assert ro.sampled_token_ids["a"] == full[1:4]  # cut after the stop token
    assert r.output_token_ids == full[:4] and r.status == RequestStatus.FINISHED_STOPPED
    assert sched.kv_cache_manager.get_num_free_blocks() == 31


def test_penalties_do_not_speculate() -> None:
    proposer = Proposer(lambda tokens, k: continuation(tokens, k))
    sched, model = make(proposer)
    rs = [
        req("p", [1, 2, 3], repetition_penalty=1.2),
        req("f", [1, 2, 4], frequency_penalty=0.5),
    ]
    for r in rs:
        sched.add_request(r)
    run_to_completion(sched, model)
    assert proposer.asked == [] and sched.make_stats().spec_decode_num_drafts == 0


def test_the_draft_models_feeds_follow_the_target_and_catch_up() -> None:
    """Draft model (core/spec_decode.py): which known tokens it computes each step, and
    how far its KV is valid after verification, preemption and a prefix hit."""
    from mlxserve.core.scheduler_output import DRAFTER_TOKEN, ModelRunnerOutput

    sched = Scheduler(
        SchedulerConfig(64, 8, 8),
        CacheConfig(32, 4, True),
        SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=4),
    )
    r = req("a", list(range(1, 11)), max_tokens=30)
    sched.add_request(r)

    def run(feed, drafts, new_tokens):
        so = sched.schedule()
        assert so.drafter_feeds.get("a") == feed
        assert so.draft_token_ids.get("a", []) == [DRAFTER_TOKEN] * drafts
        sched.update_from_output(so, ModelRunnerOutput({"a": new_tokens}))

    run((0, 8), 0, [])  # the prompt's first chunk, alongside the target
    run((8, 10), 0, [20])
    assert r.num_drafter_tokens == 10
    run((10, 11), 4, [21, 22, 23])  # it feeds t and drafts d0..d2; d0 d1 accepted
    assert (r.num_computed_tokens, r.num_drafter_tokens) == (13, 13)
    run((13, 14), 4, [24, 25, 26, 27, 28])  # all accepted: d3 was never fed to it
    assert (r.num_computed_tokens, r.num_drafter_tokens) == (18, 17)
    run((17, 19), 4, [29])  # d3 and the bonus token first; d0 rejected
    assert (r.num_computed_tokens, r.num_drafter_tokens) == (19, 19)

    sched._preempt(sched.running.pop())  # the pool is short: it recomputes later
    assert r.num_drafter_tokens == 0
    # Back with a prefix hit of 16 tokens (4 cached blocks): the target's KV is there,
    # the draft model's for this request is not; it catches up, 8 tokens per step (the
    # budget), without drafts until it is at most that far behind.
    run((0, 8), 0, [30])  # the target: prompt tokens 16..19, and a sample
    assert r.num_computed_tokens == 20
    run((8, 16), 0, [31])  # 12 behind: still no drafts
    run((16, 22), 4, [32])  # 5 behind: caught up, then drafts
    assert (r.num_computed_tokens, r.num_drafter_tokens) == (22, 22)


def test_the_draft_models_catch_up_after_plain_steps_is_not_a_drafting_cost() -> None:
    """While the cost back-off runs plain steps the draft model is not fed; the first
    step that drafts again first computes everything it missed. That catch-up is what
    switching modes costs, not what a step with drafts costs, so it must not enter the
    drafts' cost average: counted, a catch-up of hundreds of tokens (the probe interval
    grows to 512 steps) makes drafts look dear exactly when they are probed, and
    speculation stays off after drafts have become cheap.

    Fake clock: a plain step 0.1 s; a step with k=4 drafts (all accepted, 5 tokens)
    costs 0.1 s plus ``verify`` plus 0.02 s per draft-model forward, and every token the
    draft model catches up on costs 0.01 s (a tenth of a decode step)."""
    from mlxserve.core.scheduler_output import ModelRunnerOutput

    now = [0.0]
    sched = Scheduler(
        SchedulerConfig(4096, 8, 512),
        CacheConfig(600, 16, True),
        SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=4),
        clock=lambda: now[0],
    )
    # A context of 1,030-2,047 tokens throughout: one bucket of the cost back-off.
    r = req("a", [i % 50 for i in range(1030)], max_tokens=None)
    sched.add_request(r)
    verify = 0.5  # drafts first lose: (0.1 + 0.5 + 0.08 + ~0.02) / 5 tokens > 0.1

    def run(num_steps: int) -> list[bool]:
        drafted = []
        for _ in range(num_steps):
            so = sched.schedule()
            num_drafts = len(so.draft_token_ids.get("a", ()))
            fed = sum(end - start for start, end in so.drafter_feeds.values())
            now[0] += 0.1 + (verify + 0.02 * num_drafts if num_drafts else 0.0) + 0.01 * fed
            new = [7] * (1 + num_drafts) if "a" in so.sampling_request_ids else []
            sched.update_from_output(so, ModelRunnerOutput({"a": new}))
            drafted.append(num_drafts > 0)
        return drafted

    run(3)  # the prompt, 512 tokens a step
    # Drafts lose: off after the first plain probe; spec probes after 32 and 64 plain
    # steps confirm it. A probe measures 4 steps with drafts, not counting its first
    # (the catch-up), so it drafts in 5.
    first = run(8 + 4 + 32 + 5 + 64 + 5 + 120)
    assert runs(first)[:2] == [(True, 8), (False, 4 + 32)] and not any(first[-100:])
    assert sched.spec.cost.num_switches == 1
    # Drafts become cheap ((0.1 + 0.1 + 0.08 + 0.02) / 5 = 0.06 s per token, 40% less
    # than plain): the next spec probe (after 128 plain steps, in a few steps) must see it,
    # though its first step also computes the ~130 tokens the draft model missed (1.3 s).
    verify = 0.1
    second = run(40)
    assert second[-20:] == [True] * 20, runs(second)
    assert r.num_tokens < 2048
    assert sched.spec.cost.num_switches == 2


def runs(flags: list[bool]) -> list[tuple[bool, int]]:
    """The flags as (value, run length) pairs."""
    out: list[tuple[bool, int]] = []
    for f in flags:
        if out and out[-1][0] == f:
            out[-1] = (f, out[-1][1] + 1)
        else:
            out.append((f, 1))
    return out
