"""Async scheduling in the scheduler: step N+1 is scheduled before step N's output is back.

The driver keeps one step ahead, as LLMEngine does: schedule N+1, update from N (abort
some requests now, as a client or a stop string would), then run N+1 on the fake model of
tests/scheduler_harness.py (it reads every context back from the simulated paged cache).
Oracles: the cache-less reference loop for every request's tokens, the pool invariants,
and hand-derived placeholders, limits and prefix-cache hashes in small cases.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, given, settings

from mlxserve.config import CacheConfig, SchedulerConfig
from mlxserve.core.request import Request, RequestStatus
from mlxserve.core.scheduler import Scheduler, SchedulerOutput
from mlxserve.core.scheduler_output import PLACEHOLDER_TOKEN
from mlxserve.sampling_params import SamplingParams
from tests.scheduler_harness import (
    PagedFakeModel,
    check_all_released,
    check_pool,
    next_token,
    reference_generate,
    request_of,
)
from tests.test_scheduler_properties import EOS, scenarios


class AsyncDriver:
    """Runs a scheduler one step ahead; counts each request's sampled tokens (discarded
    extra ones included)."""

    def __init__(self, sched: Scheduler, model: PagedFakeModel) -> None:
        self.sched, self.model = sched, model
        self.in_flight: tuple[SchedulerOutput, object] | None = None
        self.num_sampled: Counter[str] = Counter()

    def _run(self, so: SchedulerOutput):
        for rid in so.sampling_request_ids:
            self.num_sampled[rid] += 1
        return self.model.execute(so)

    def step(self) -> None:
        if self.in_flight is None:
            so = self.sched.schedule()
            assert not so.placeholder_request_ids  # nothing was in flight
            self.in_flight = (so, self._run(so))
        so, ro = self.in_flight
        ahead = self.sched.schedule()
        # A placeholder is the token the step in flight samples for that request.
        assert ahead.placeholder_request_ids <= so.sampling_request_ids
        for req in ahead.scheduled_requests:
            if req.request_id in ahead.placeholder_request_ids:
                assert ahead.token_ids(req) == [PLACEHOLDER_TOKEN]
        self.sched.update_from_output(so, ro)
        pool = self.sched.kv_cache_manager.block_pool
        live = self.sched.kv_cache_manager.managers[0].req_to_blocks.values()
        check_pool(pool, [[b.block_id for b in blocks] for blocks in live])
        # Nothing hashed covers a token whose K/V a step not yet run would write.
        for req in self.sched.requests.values():
            if req.status == RequestStatus.RUNNING:
                num_known = req.num_computed_tokens - req.num_uncollected_tokens
                num_cached = self.sched.kv_cache_manager.managers[0].num_cached_blocks.get(
                    req.request_id, 0
                )
                assert num_cached * self.sched.block_size <= num_known, req
        # The placeholders are known now: the fake model runs the step ahead.
        self.in_flight = (ahead, self._run(ahead)) if ahead.scheduled_requests else None

    def run_to_completion(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if self.in_flight is None and not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_random_streams_scheduled_ahead_finish_with_the_reference_tokens(scenario):
    """Random add / step / abort streams over tiny pools (preemption, prefix hits, chunked
    prompts): every request ends with the reference loop's tokens, no step samples past a
    request's max_tokens or length, EOS costs at most one discarded token, nothing leaks."""
    scheduler_config, cache_config, ops, _ = scenario
    max_model_len = scheduler_config.max_model_len
    block_size, num_blocks = cache_config.block_size, cache_config.num_blocks
    sched = Scheduler(scheduler_config, cache_config)
    driver = AsyncDriver(sched, PagedFakeModel(block_size, num_blocks))
    pool_tokens = (num_blocks - 1) * block_size
    cap = min(max_model_len, pool_tokens + 1)
    added: list[Request] = []
    aborted: set[str] = set()
    for op in ops:
        if op[0] == "add":
            prompt = op[1]
            if not 1 <= len(prompt) <= max_model_len - 1 or len(prompt) > pool_tokens:
                continue
            r = request_of(op, len(added), EOS)
            sched.add_request(r)
            added.append(r)
        elif op[0] == "step":
            driver.step()
        elif added:  # between steps: a step may be in flight for it
            r = added[op[1] % len(added)]
            if not r.is_finished:
                aborted.add(r.request_id)
            sched.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    driver.run_to_completion()

    for r in added:
        eos = frozenset() if r.sampling_params.ignore_eos else EOS
        want = reference_generate(
            r.prompt_token_ids, r.max_tokens, cap, eos, r.sampling_params.min_tokens
        )
        sampled = driver.num_sampled[r.request_id]
        if r.request_id in aborted:
            assert r.output_token_ids == want[: r.num_output_tokens]
            continue
        assert r.output_token_ids == want, r
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert sampled == r.num_output_tokens, r
        else:
            assert r.num_output_tokens <= sampled <= r.num_output_tokens + 1, r
        assert r.num_output_placeholders == 0
    check_all_released(sched, num_blocks)
    stats = sched.make_stats()
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hit: {stats.prefix_cache_hits > 0}")
    event(f"aborted: {bool(aborted)}")


def make(num_blocks: int = 16, block_size: int = 4, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(64, 4, budget), CacheConfig(num_blocks, block_size, True))


def test_a_decode_is_scheduled_on_its_placeholder_and_stops_at_max_tokens() -> None:
    """Prompt of 7, max_tokens 3: the prefill samples token 0; ahead of it, a decode of
    position 7 (its input, token 0, is a placeholder); ahead of that update, position 8;
    then nothing more: the third token in flight is the last one allowed."""
    sched = make()
    prompt = [3, 4, 5, 6, 7, 8, 9]
    r = Request("r", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request(r)
    model = PagedFakeModel(4, 16)
    s0 = sched.schedule()
    assert s0.num_scheduled_tokens == {"r": 7} and s0.sampling_request_ids == {"r"}
    ro0 = model.execute(s0)
    s1 = sched.schedule()  # before s0's token is known
    assert s1.start_positions == {"r": 7} and s1.placeholder_request_ids == {"r"}
    assert s1.token_ids(r) == [PLACEHOLDER_TOKEN] and s1.sampling_request_ids == {"r"}
    assert r.num_output_placeholders == 2 and r.num_computed_tokens == 8
    sched.update_from_output(s0, ro0)
    assert r.output_token_ids == [next_token(prompt)] and r.num_output_placeholders == 1
    assert s1.token_ids(r) == r.output_token_ids  # known now
    ro1 = model.execute(s1)
    s2 = sched.schedule()
    assert s2.start_positions == {"r": 8} and s2.placeholder_request_ids == {"r"}
    sched.update_from_output(s1, ro1)
    ro2 = model.execute(s2)
    s3 = sched.schedule()  # output 2 known + 1 in flight = max_tokens: no step past it
    assert s3.scheduled_requests == []
    sched.update_from_output(s2, ro2)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 3


def test_blocks_are_hashed_only_once_the_step_writing_them_is_back() -> None:
    """Block size 4, prompt of 7: after the prefill's update, the decode of position 7 is
    in flight, so block 1 (positions 4-7) holds a K/V not yet known to be written: only
    block 0 is cached. After that decode's update, block 1 is cached too."""
    sched = make()
    r = Request("r", [3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True))
    sched.add_request(r)
    model = PagedFakeModel(4, 16)
    cached = sched.kv_cache_manager.managers[0].num_cached_blocks
    s0 = sched.schedule()
    ro0 = model.execute(s0)
    s1 = sched.schedule()
    sched.update_from_output(s0, ro0)  # 8 tokens known; position 7's K/V in flight
    assert r.num_tokens == 8 and r.num_computed_tokens == 8 and cached["r"] == 1
    ro1 = model.execute(s1)
    s2 = sched.schedule()
    sched.update_from_output(s1, ro1)
    assert r.num_computed_tokens == 9 and cached["r"] == 2
    sched.update_from_output(s2, model.execute(s2))


def test_a_request_preempted_with_its_token_in_flight_waits_for_it() -> None:
    """Two requests in a pool of 4 usable blocks of 2 tokens. Scheduling ahead, the newer
    one is preempted while its token is in flight: it is not readmitted in that step, its
    token is kept when it arrives, and it then recomputes and finishes with the reference
    tokens."""
    sched = Scheduler(SchedulerConfig(64, 4, 64), CacheConfig(5, 2, True))
    model = PagedFakeModel(2, 5)
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=4, ignore_eos=True))
    b = Request("b", [5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add_request(a)
    sched.add_request(b)
    driver = AsyncDriver(sched, model)
    driver.step()  # both prefilled (4 blocks), first tokens in flight: no room to decode
    (so, _) = driver.in_flight
    assert so.preempted_request_ids == ["b"] and b.status == RequestStatus.PREEMPTED
    assert b.num_output_tokens == 1 and b.num_output_placeholders == 0  # its token arrived
    driver.run_to_completion()
    for r in (a, b):
        want = reference_generate(r.prompt_token_ids, 4, 64)
        assert r.output_token_ids == want and r.status == RequestStatus.FINISHED_LENGTH
    assert b.num_preemptions == 1
