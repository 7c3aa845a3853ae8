"""Property tests: random add / step / abort streams over random pools, block sizes and budgets.

After every step: free + used + null == total blocks, ref counts equal the block-table
references (so never negative), the token budget and max_num_seqs hold, and the fake model
reads exactly the right tokens back from the paged cache. In the end every request has
finished with the tokens of a cache-less reference loop, and no block leaks. Half of the
streams speculate (drafts right, partly right or wrong): the same must hold.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mlxserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from mlxserve.core.request import Request, RequestStatus
from mlxserve.core.scheduler import Scheduler
from mlxserve.kv_cache_spec import FULL_ATTENTION, SLIDING_WINDOW, KVCacheGroupSpec
from mlxserve.sampling_params import SamplingParams
from tests.scheduler_harness import (
    VOCAB,
    OracleProposer,
    PagedFakeModel,
    check_all_released,
    reference_generate,
    request_of,
    run_to_completion,
    step,
)

EOS = frozenset({0})
# Speculative decoding: off, or k drafts from a proposer that is right only sometimes.
SPEC = st.one_of(
    st.none(),
    st.builds(
        SpeculativeConfig,
        num_speculative_tokens=st.integers(1, 5),
        disable_by_batch_size=st.integers(1, 4),
        min_acceptance_rate=st.sampled_from([0.0, 0.3]),
    ),
)


def make_scheduler(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    spec: SpeculativeConfig | None,
) -> Scheduler:
    sched = Scheduler(scheduler_config, cache_config, spec)
    if sched.spec is not None:
        sched.spec.proposer = OracleProposer()
    return sched


# Shared prefixes make prefix-cache hits (and hash-chain bugs) likely.
BASES = [[(11 * k + 3 * i + 1) % VOCAB for i in range(48)] for k in range(3)]


@st.composite
def prompts(draw: st.DrawFn, limit: int) -> list[int]:
    """A prompt often sharing a prefix with others, mostly within limit tokens, sometimes over."""
    length = draw(st.one_of(st.just(limit), st.integers(1, limit + 2)))
    base = BASES[draw(st.one_of(st.just(0), st.integers(0, len(BASES) - 1)))]
    num_shared = draw(st.one_of(st.just(length), st.integers(0, length)))
    suffix = st.lists(
        st.integers(1, VOCAB - 1), min_size=length - num_shared, max_size=length - num_shared
    )
    return base[:num_shared] + draw(suffix)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[SchedulerConfig, CacheConfig, list[tuple]]:
    """A small engine (so preemption and eviction happen) and an add / step / abort stream."""
    block_size = draw(st.integers(1, 5))
    # one_of: tiny edge cases, but not only those (hypothesis favours small integers).
    num_blocks = draw(st.one_of(st.integers(2, 4), st.integers(5, 16)))
    cache_config = CacheConfig(num_blocks, block_size, draw(st.booleans()))
    scheduler_config = SchedulerConfig(
        max_model_len=draw(st.one_of(st.integers(2, 8), st.integers(9, 48))),
        max_num_seqs=draw(st.integers(1, 4)),
        max_num_batched_tokens=draw(st.integers(1, 16)),
    )
    pool_tokens = (cache_config.num_blocks - 1) * block_size
    limit = min(scheduler_config.max_model_len - 1, pool_tokens, len(BASES[0]))
    add = st.tuples(
        st.just("add"),
        prompts(limit),
        st.one_of(st.none(), st.integers(1, 8)),  # max_tokens
        st.integers(0, 3),  # min_tokens
        st.booleans(),  # ignore_eos
    )
    step_op, abort_op = st.just(("step",)), st.tuples(st.just("abort"), st.integers(0, 30))
    op = st.one_of(add, add, step_op, step_op, abort_op)
    ops = draw(st.lists(op, min_size=4, max_size=40))
    return scheduler_config, cache_config, ops, draw(SPEC)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_random_streams_keep_invariants_and_finish(scenario):
    scheduler_config, cache_config, ops, spec = scenario
    max_model_len = scheduler_config.max_model_len
    block_size, num_blocks = cache_config.block_size, cache_config.num_blocks
    sched = make_scheduler(scheduler_config, cache_config, spec)
    model = PagedFakeModel(block_size, num_blocks)
    pool_tokens = (num_blocks - 1) * block_size
    cap = min(max_model_len, pool_tokens + 1)  # the longest a request may grow
    added: list[Request] = []
    aborted: set[str] = set()

    for op in ops:
        if op[0] == "add":
            prompt = op[1]
            if not 1 <= len(prompt) <= max_model_len - 1:
                continue  # LLMEngine.add_request rejects it before the scheduler sees it
            r = request_of(op, len(added), EOS)
            fits = len(prompt) <= pool_tokens
            try:
                sched.add_request(r)
            except ValueError:
                assert not fits
                continue
            assert fits
            added.append(r)
        elif op[0] == "step":
            step(sched, model)
        elif added:
            r = added[op[1] % len(added)]
            if not r.is_finished:
                aborted.add(r.request_id)
            sched.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)

    run_to_completion(sched, model)

    for r in added:
        eos = frozenset() if r.sampling_params.ignore_eos else EOS
        want = reference_generate(
            r.prompt_token_ids, r.max_tokens, cap, eos, r.sampling_params.min_tokens
        )
        if r.request_id in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
            assert r.output_token_ids == want[: r.num_output_tokens]
        else:
            assert r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
            assert r.output_token_ids == want, r
    check_all_released(sched, num_blocks)
    stats = sched.make_stats()
    assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries
    event(f"requests: {min(len(added), 5)}+" if len(added) >= 5 else f"requests: {len(added)}")
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hit: {stats.prefix_cache_hits > 0}")
    event(f"aborted: {bool(aborted)}")
    event(f"drafts accepted: {stats.spec_decode_num_accepted_tokens > 0}")
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens


# KV cache groups (full attention, windows) with or without recurrent state, as models have.
HYBRIDS = [
    ((None,), False),
    ((3,), False),
    ((None, 5), False),
    ((None, 2, 7), False),
    ((None,), True),
    ((4,), True),
    ((None, 6), True),
]


@st.composite
def hybrid_scenarios(draw: st.DrawFn):
    """As scenarios(), with KV cache groups, windows and recurrent state slots."""
    windows, has_state = draw(st.sampled_from(HYBRIDS))
    block_size = draw(st.integers(1, 5))
    groups = tuple(
        KVCacheGroupSpec(FULL_ATTENTION if w is None else SLIDING_WINDOW, w, ()) for w in windows
    )
    interval = draw(st.integers(0, 3)) * block_size
    cache_config = CacheConfig(
        draw(st.one_of(st.integers(2, 6), st.integers(7, 16))),
        block_size,
        draw(st.sampled_from([True, True, True, False])),
        groups=groups,
        num_state_slots=draw(st.integers(2, 12)) if has_state else 0,
        snapshot_interval=interval if has_state else 0,
    )
    scheduler_config = SchedulerConfig(
        max_model_len=draw(st.one_of(st.integers(2, 8), st.integers(9, 48))),
        max_num_seqs=draw(st.integers(1, 4)),
        max_num_batched_tokens=draw(st.integers(1, 16)),
    )
    limit = min(scheduler_config.max_model_len - 1, len(BASES[0]))
    add = st.tuples(
        st.just("add"),
        prompts(limit),
        st.one_of(st.none(), st.integers(1, 8)),
        st.integers(0, 3),
        st.booleans(),
    )
    step_op, abort_op = st.just(("step",)), st.tuples(st.just("abort"), st.integers(0, 30))
    op = st.one_of(add, add, step_op, step_op, step_op, abort_op)
    ops = draw(st.lists(op, min_size=4, max_size=60))
    return windows, scheduler_config, cache_config, ops, None if has_state else draw(SPEC)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=hybrid_scenarios())
def test_hybrid_streams_keep_invariants_and_finish(scenario):
    """Windows release blocks, state slots and snapshots come and go: the fake model still
    reads every window's tokens and every state back exactly, and nothing leaks."""
    windows, scheduler_config, cache_config, ops, spec = scenario
    sched = make_scheduler(scheduler_config, cache_config, spec)
    model = PagedFakeModel(cache_config.block_size, cache_config.num_blocks, windows=windows)
    pool_tokens = sched.num_pool_tokens
    cap = sched.max_num_tokens
    added: list[Request] = []
    aborted: set[str] = set()
    for op in ops:
        if op[0] == "add":
            prompt = op[1]
            if not 1 <= len(prompt) <= scheduler_config.max_model_len - 1:
                continue
            r = request_of(op, len(added), EOS)
            fits = pool_tokens is None or len(prompt) <= pool_tokens
            try:
                sched.add_request(r)
            except ValueError:
                assert not fits
                continue
            assert fits
            added.append(r)
        elif op[0] == "step":
            step(sched, model)
        elif added:
            r = added[op[1] % len(added)]
            if not r.is_finished:
                aborted.add(r.request_id)
            sched.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)

    run_to_completion(sched, model)

    for r in added:
        eos = frozenset() if r.sampling_params.ignore_eos else EOS
        want = reference_generate(
            r.prompt_token_ids, r.max_tokens, cap, eos, r.sampling_params.min_tokens
        )
        if r.request_id in aborted:
            assert r.output_token_ids == want[: r.num_output_tokens]
        else:
            assert r.output_token_ids == want, r
    check_all_released(sched, cache_config.num_blocks)
    kv = sched.kv_cache_manager
    stats = sched.make_stats()
    event(f"groups {windows}, state {kv.state_pool is not None}")
    event(f"prefix hit: {stats.prefix_cache_hits > 0}")
    event(f"preempted: {stats.num_preemptions > 0}")


@st.composite
def busy_scenarios(draw: st.DrawFn) -> tuple[SchedulerConfig, CacheConfig, list[tuple]]:
    """Memory to spare (no preemption), more seats than budget: only the budget decides."""
    block_size = draw(st.integers(1, 5))
    max_num_seqs = draw(st.integers(1, 24))
    max_model_len = 32
    num_blocks = max_num_seqs * -(-max_model_len // block_size) + 1
    scheduler_config = SchedulerConfig(max_model_len, max_num_seqs, draw(st.integers(1, 16)))
    add = st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 12))
    ops = draw(st.lists(st.one_of(add, st.just(("step",))), min_size=4, max_size=60))
    return scheduler_config, CacheConfig(num_blocks, block_size, False), ops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=busy_scenarios())
def test_every_decode_runs_and_prefill_gets_its_share_each_step(scenario):
    # The policy, restated: all decodes run; prefill work (running chunks, then waiting
    # prompts up to the free seats) gets max(budget - decodes, ceil(budget / 2)) tokens.
    scheduler_config, cache_config, ops = scenario
    budget, max_num_seqs = scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs
    sched = Scheduler(scheduler_config, cache_config)
    model = PagedFakeModel(cache_config.block_size, cache_config.num_blocks)
    added: list[Request] = []
    # Every step makes progress (at least a token), so the whole work bounds the steps.
    work_steps = sum(op[1] + op[2] for op in ops if op[0] == "add")
    for op in [*ops, *[("step",)] * work_steps]:
        if op[0] == "step" and not sched.has_unfinished_requests():
            continue
        if op[0] == "add":
            prompt = [(len(added) * 7 + i) % (VOCAB - 1) + 1 for i in range(op[1])]
            added.append(Request(f"r{len(added)}", prompt, SamplingParams(max_tokens=op[2])))
            sched.add_request(added[-1])
            continue
        decodes = {r.request_id for r in sched.running if r.num_tokens - r.num_computed_tokens == 1}
        work = sum(r.num_tokens - r.num_computed_tokens for r in sched.running) - len(decodes)
        seats = max_num_seqs - len(sched.running)
        work += sum(r.num_tokens for r in list(sched.waiting)[:seats])
        share = max(budget - len(decodes), -(-budget // 2))
        out = step(sched, model)
        assert not out.preempted_request_ids
        assert decodes <= set(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens - len(decodes) == min(share, work)
    assert all(r.is_finished for r in added)
    for r in added:
        assert r.output_token_ids == reference_generate(r.prompt_token_ids, r.max_tokens, 32)
