"""Scheduler scenarios with a fake model over a simulated paged KV cache.

Outputs are checked against reference_generate (a plain loop with no cache at all), so
chunking, batching, prefix hits and preemption must not change any token.
"""

from __future__ import annotations

import pytest

from mlxserve.config import CacheConfig, SchedulerConfig
from mlxserve.core.request import Request, RequestStatus
from mlxserve.core.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput
from mlxserve.exceptions import ParameterError
from mlxserve.sampling_params import SamplingParams
from tests.scheduler_harness import PagedFakeModel, reference_generate, run_to_completion, step


def make(
    num_blocks: int = 32,
    block_size: int = 4,
    max_model_len: int = 64,
    budget: int = 64,
    max_num_seqs: int = 8,
    caching: bool = True,
    script: dict[str, list[int]] | None = None,
) -> tuple[Scheduler, PagedFakeModel]:
    sched = Scheduler(
        SchedulerConfig(max_model_len, max_num_seqs, budget),
        CacheConfig(num_blocks, block_size, caching),
    )
    return sched, PagedFakeModel(block_size, num_blocks, script)


def req(rid: str, prompt: list[int], eos: frozenset[int] = frozenset(), **params) -> Request:
    params.setdefault("max_tokens", 4)
    return Request(rid, prompt, SamplingParams(**params), eos_token_ids=eos)


def layout(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, start position, tokens) in batch order."""
    return [
        (r.request_id, out.start_positions[r.request_id], out.num_scheduled_tokens[r.request_id])
        for r in out.scheduled_requests
    ]


def oracle(r: Request, sched: Scheduler) -> list[int]:
    return reference_generate(r.prompt_token_ids, r.max_tokens, sched.max_num_tokens)


def test_chunked_prefill_interleaves_with_decodes():
    sched, model = make(budget=8)
    a = req("a", [1, 2, 3], max_tokens=6)
    b = req("b", list(range(10, 30)), max_tokens=2)
    sched.add_request(a)
    out = step(sched, model)
    assert layout(out) == [("a", 0, 3)] and out.sampling_request_ids == {"a"}
    sched.add_request(b)
    expected = [
        ([("a", 3, 1), ("b", 0, 7)], {"a"}, 1),
        ([("a", 4, 1), ("b", 7, 7)], {"a"}, 1),
        ([("a", 5, 1), ("b", 14, 6)], {"a", "b"}, 1),
        ([("a", 6, 1), ("b", 20, 1)], {"a", "b"}, 2),
        ([("a", 7, 1)], {"a"}, 1),
    ]
    for want_layout, want_sampling, want_decodes in expected:
        out = step(sched, model)
        assert layout(out) == want_layout
        assert out.sampling_request_ids == want_sampling
        assert out.num_decodes == want_decodes
    assert not sched.has_unfinished_requests()
    assert a.output_token_ids == oracle(a, sched) and len(a.output_token_ids) == 6
    assert b.output_token_ids == oracle(b, sched) and len(b.output_token_ids) == 2
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH


def test_decodes_come_first_in_batch_order():
    sched, model = make(budget=64)
    sched.add_request(req("a", [1, 2, 3, 4, 5], max_tokens=3))
    step(sched, model)
    sched.add_request(req("b", [7, 8, 9]))
    out = step(sched, model)
    assert layout(out) == [("a", 5, 1), ("b", 0, 3)] and out.num_decodes == 1
    # b was admitted after a; in a mixed batch the decode of the newer one still leads.
    sched.add_request(req("c", list(range(20, 26))))
    out = step(sched, model)
    assert layout(out) == [("a", 6, 1), ("b", 3, 1), ("c", 0, 6)] and out.num_decodes == 2


def test_resumed_decode_is_batched_before_older_chunk():
    # block_size 1: a preempted request resumes with every token but the last cached,
    # so its recompute is a one-token decode; it goes ahead of an older request's chunk.
    sched, model = make(num_blocks=8, block_size=1, budget=8, max_num_seqs=3)
    a, b, c = req("a", [1], max_tokens=5), req("b", [1, 2], max_tokens=6), req("c", [1])
    sched.add_request(a)
    sched.add_request(b)
    assert layout(step(sched, model)) == [("a", 0, 1), ("b", 0, 2)]
    sched.add_request(c)
    assert layout(step(sched, model)) == [("a", 1, 1), ("b", 2, 1), ("c", 0, 1)]
    assert step(sched, model).preempted_request_ids == ["c"]
    assert step(sched, model).preempted_request_ids == ["b"]
    assert layout(step(sched, model)) == [("a", 4, 1)] and a.is_finished
    out = step(sched, model)
    assert [r.request_id for r in sched.running] == ["b", "c"]  # b was admitted first
    assert layout(out) == [("c", 1, 1), ("b", 2, 3)] and out.num_decodes == 1
    assert out.block_ids == {"b": ([1, 3, 2, 5, 6],), "c": ([1, 7],)}  # block 1 (token 1) shared
    assert sched.kv_cache_manager.block_pool.blocks[1].ref_cnt == 2
    run_to_completion(sched, model)
    for r in (a, b, c):
        assert r.output_token_ids == oracle(r, sched), r.request_id


def test_max_num_seqs_caps_the_batch():
    sched, model = make(max_num_seqs=2)
    reqs = [req(rid, [i * 10 + j for j in range(4)], max_tokens=2) for i, rid in enumerate("abc")]
    for r in reqs:
        sched.add_request(r)
    out = step(sched, model)
    assert layout(out) == [("a", 0, 4), ("b", 0, 4)]
    assert len(sched.running) == 2 and len(sched.waiting) == 1
    out = step(sched, model)
    assert layout(out) == [("a", 4, 1), ("b", 4, 1)]
    out = step(sched, model)
    assert layout(out) == [("c", 0, 4)] and out.finished_request_ids == ["a", "b"]
    step(sched, model)
    assert not sched.has_unfinished_requests()
    for r in reqs:
        assert r.output_token_ids == oracle(r, sched)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_requeues_newest_at_front_and_recomputes(caching: bool):
    sched, model = make(num_blocks=5, block_size=2, caching=caching)  # 4 usable blocks
    a, b, c = req("a", [1, 2, 3]), req("b", [4, 5, 6]), req("c", [7, 8, 9])
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched, model)
    assert out.block_ids == {"a": ([1, 2],), "b": ([3, 4],)}
    sched.add_request(c)
    out = step(sched, model)  # c does not fit: 0 free blocks
    assert layout(out) == [("a", 3, 1), ("b", 3, 1)] and len(sched.waiting) == 1

    # a needs a third block: b (newest) is preempted; a gets b's last block.
    out = step(sched, model)
    assert out.preempted_request_ids == ["b"] and layout(out) == [("a", 4, 1)]
    assert out.block_ids == {"a": ([1, 2, 4],)}
    assert list(sched.waiting) == [b, c] and b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1 and b.num_output_tokens == 2
    assert sched.make_stats().num_preemptions == 1

    out = step(sched, model)  # b needs 3 blocks, 1 free: it waits; a finishes
    assert layout(out) == [("a", 5, 1)] and a.is_finished
    out = step(sched, model)
    # b recomputes prompt + outputs (block 3, its first block, still cached if caching).
    assert layout(out) == ([("b", 2, 3)] if caching else [("b", 0, 5)])
    assert out.block_ids["b"] == ([3, 4, 2],) and out.sampling_request_ids == {"b"}
    assert list(sched.waiting) == [c]
    run_to_completion(sched, model)
    for r in (a, b, c):
        assert r.output_token_ids == oracle(r, sched), r.request_id
    assert b.num_cached_tokens == 0  # set at first admission only
    assert sched.kv_cache_manager.get_num_free_blocks() == 4


def test_request_preempting_itself_stops_the_running_pass():
    sched, model = make(num_blocks=4, block_size=2, caching=False)  # 3 usable blocks
    a, b = req("a", [1], max_tokens=3), req("b", [2, 3, 4, 5])
    sched.add_request(a)
    sched.add_request(b)
    assert step(sched, model).block_ids == {"a": ([1],), "b": ([2, 3],)}
    out = step(sched, model)  # b (newest) needs a 3rd block: it is its own victim
    assert out.preempted_request_ids == ["b"] and layout(out) == [("a", 1, 1)]
    assert list(sched.waiting) == [b] and sched.running == [a]
    run_to_completion(sched, model)
    assert a.output_token_ids == oracle(a, sched)
    assert b.output_token_ids == oracle(b, sched)


def test_prefix_hit_through_scheduler_shares_blocks():
    sched, model = make(num_blocks=16, block_size=4)
    a = req("a", list(range(10)), max_tokens=5)
    sched.add_request(a)
    assert step(sched, model).block_ids == {"a": ([1, 2, 3],)}
    b = req("b", list(range(8)) + [70, 71, 72])
    sched.add_request(b)
    out = step(sched, model)
    assert layout(out) == [("a", 10, 1), ("b", 8, 3)]
    assert out.block_ids["b"] == ([1, 2, 4],) and b.num_cached_tokens == 8
    assert [sched.kv_cache_manager.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [
        2,
        2,
        1,
        1,
    ]
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11, 8)
    assert stats.num_running_reqs == 2 and stats.kv_cache_usage == pytest.approx(4 / 15)
    run_to_completion(sched, model)
    assert a.output_token_ids == oracle(a, sched) and b.output_token_ids == oracle(b, sched)


def test_prompt_larger_than_the_pool_is_rejected_with_numbers():
    # Empty or too long for max_model_len is LLMEngine.add_request's check (test_engine.py).
    small, model = make(num_blocks=3, block_size=4, max_model_len=100)  # 8 pool tokens
    with pytest.raises(
        ParameterError,
        match=r"prompt has 9 tokens, but the whole KV cache holds 8 tokens \(2 blocks of 4\)",
    ) as e:
        small.add_request(req("big", list(range(9))))
    assert e.value.parameter == "prompt"
    assert not small.has_unfinished_requests()
    # A prompt that fills the pool gets one token, then stops for length.
    r = req("full", list(range(8)), max_tokens=10)
    small.add_request(r)
    step(small, model)
    assert r.num_output_tokens == 1 and r.status == RequestStatus.FINISHED_LENGTH


EOS = frozenset({2})


@pytest.mark.parametrize(
    ("params", "script", "want", "status", "stop_reason"),
    [
        ({"max_tokens": 10}, [5, 2, 7], [5, 2], RequestStatus.FINISHED_STOPPED, None),
        (
            {"max_tokens": 4, "ignore_eos": True},
            [5, 2, 7, 8, 9],
            [5, 2, 7, 8],
            RequestStatus.FINISHED_LENGTH,
            None,
        ),
        (
            {"max_tokens": 10, "min_tokens": 2},
            [2, 2, 2, 9],
            [2, 2, 2],
            RequestStatus.FINISHED_STOPPED,
            None,
        ),
        (
            {"max_tokens": 10, "stop_token_ids": [9]},
            [5, 9, 1],
            [5, 9],
            RequestStatus.FINISHED_STOPPED,
            9,
        ),
        (
            {"max_tokens": 10, "stop_token_ids": [9], "min_tokens": 1},
            [9, 9, 1],
            [9, 9],
            RequestStatus.FINISHED_STOPPED,
            9,
        ),
        (
            {"max_tokens": 10, "stop_token_ids": [9], "ignore_eos": True},
            [2, 9],
            [2, 9],
            RequestStatus.FINISHED_STOPPED,
            9,
        ),
        ({"max_tokens": 3}, [5, 6, 7, 8], [5, 6, 7], RequestStatus.FINISHED_LENGTH, None),
        ({"max_tokens": 2}, [5, 2], [5, 2], RequestStatus.FINISHED_STOPPED, None),
        (
            {"max_tokens": None, "max_model_len": 8},
            [5, 6, 7, 8, 9],
            [5, 6, 7],
            RequestStatus.FINISHED_LENGTH,
            None,
        ),
    ],
    ids=[
        "eos",
        "ignore_eos",
        "min_tokens",
        "stop_token",
        "min_tokens_stop_token",
        "stop_token_with_ignore_eos",
        "max_tokens",
        "eos_on_last_allowed",
        "max_model_len",
    ],
)
def test_stop_conditions(params, script, want, status, stop_reason):
    params = dict(params)
    sched, model = make(max_model_len=params.pop("max_model_len", 64), script={"r": script})
    r = req("r", [10, 11, 12, 13, 14], eos=EOS, **params)
    sched.add_request(r)
    run_to_completion(sched, model)
    assert r.output_token_ids == want
    assert r.status == status and r.stop_reason == stop_reason
    assert sched.kv_cache_manager.get_num_free_blocks() == 31


def test_update_returns_requests_with_new_tokens():
    sched, model = make(budget=4)
    a, b = req("a", [1, 2]), req("b", list(range(10, 16)))
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert layout(out) == [("a", 0, 2), ("b", 0, 2)]
    assert sched.update_from_output(out, model.execute(out)) == [a]  # b's chunk samples nothing


def test_abort_waiting_and_running_frees_everything():
    sched, model = make(max_num_seqs=1)
    a, b = req("a", list(range(9))), req("b", [1, 2])
    sched.add_request(a)
    sched.add_request(b)
    step(sched, model)
    assert len(sched.running) == 1 and len(sched.waiting) == 1
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED and not sched.waiting
    sched.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED and a.status.finish_reason == "abort"
    assert not sched.has_unfinished_requests() and sched.running == []
    kv = sched.kv_cache_manager
    assert kv.get_num_free_blocks() == 31 and kv.managers[0].req_to_blocks == {}
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)
    out = sched.schedule()
    assert not out.scheduled_requests and out.finished_request_ids == ["b", "a"]
    assert sched.schedule().finished_request_ids == []


def test_abort_between_schedule_and_update():
    sched, model = make()
    a = req("a", [1, 2, 3])
    sched.add_request(a)
    out = sched.schedule()
    result = model.execute(out)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, result) == []
    assert a.output_token_ids == [] and sched.kv_cache_manager.get_num_free_blocks() == 31


def test_finish_requests_stop_string():
    sched, model = make()
    a = req("a", list(range(9)), max_tokens=10)
    sched.add_request(a)
    step(sched, model)
    sched.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert a.status.finish_reason == "stop" and sched.kv_cache_manager.get_num_free_blocks() == 31
    # Its full blocks stay cached for the next turn of the conversation.
    follow_up = req("b", list(range(9)) + a.output_token_ids + [40])
    sched.add_request(follow_up)
    out = step(sched, model)
    assert layout(out) == [("b", 8, 3)] and out.finished_request_ids == ["a"]


def test_model_runner_output_must_match_sampling_requests():
    sched, _ = make(budget=2)
    sched.add_request(req("a", [1, 2, 3]))
    out = sched.schedule()  # partial chunk: must not sample
    with pytest.raises(AssertionError):
        sched.update_from_output(out, ModelRunnerOutput({"a": [5]}))


def test_output_maps_onto_attention_metadata():
    from mlxserve.ops.metadata import AttentionMetadata

    sched, model = make(budget=10, block_size=4)
    sched.add_request(req("a", [1, 2, 3, 4, 5]))
    sched.add_request(req("b", [6, 7]))
    step(sched, model)
    sched.add_request(req("c", list(range(20, 32))))
    out = sched.schedule()
    assert layout(out) == [("a", 5, 1), ("b", 2, 1), ("c", 0, 8)]
    rids = [r.request_id for r in out.scheduled_requests]
    starts = [out.start_positions[rid] for rid in rids]
    query_lens = [out.num_scheduled_tokens[rid] for rid in rids]
    context_lens = [s + q for s, q in zip(starts, query_lens, strict=True)]
    meta = AttentionMetadata.build(query_lens, context_lens, [out.block_ids[r][0] for r in rids], 4)
    assert meta.num_decodes == out.num_decodes == 2
    assert meta.positions() == [5, 2, 0, 1, 2, 3, 4, 5, 6, 7]
    # a: [1, 2], b: [3], c: [4, 5]: slot = block_id * block_size + position % block_size
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 3 * 4 + 2, 16, 17, 18, 19, 20, 21, 22, 23]
    # The sampled rows are the last token of each sampling request.
    assert [rid for rid in rids if out.samples(rid)] == ["a", "b"]


def test_prefill_gets_half_the_budget_beside_more_decodes_than_the_budget():
    # Budget 8, 12 running decodes: before, the decodes took all 8 tokens every step and
    # a new prompt waited until a stream ended (issue 11, starvation on a busy server).
    sched, model = make(num_blocks=128, block_size=4, budget=8, max_num_seqs=13)
    decoders = [req(f"d{i}", [i + 1], max_tokens=20) for i in range(12)]
    for r in decoders:
        sched.add_request(r)
    ramp = [[(f"d{i}", 0, 1) for i in range(8)], [(f"d{i}", 1, 1) for i in range(8)]]
    ramp[1] += [("d8", 0, 1), ("d9", 0, 1), ("d10", 0, 1), ("d11", 0, 1)]  # 8 decodes + 4
    for want in ramp:
        assert layout(step(sched, model)) == want
    p, q = req("p", list(range(30, 48)), max_tokens=2), req("q", [7, 8])
    sched.add_request(p)
    sched.add_request(q)  # 14th request: waits for a free seat (max_num_seqs 13)
    # 12 decodes + ceil(8 / 2) = 4 prefill tokens per step: 16 > 8 tokens, all decodes kept.
    for start, n in [(0, 4), (4, 4), (8, 4), (12, 4), (16, 2)]:
        out = step(sched, model)
        decodes = [(r.request_id, 1) for r in out.scheduled_requests[:12]]
        assert decodes == [(f"d{i}", 1) for i in range(12)] and out.num_decodes == 12
        assert layout(out)[12:] == [("p", start, n)]
        assert out.total_num_scheduled_tokens == 12 + n
    assert p.num_output_tokens == 1 and len(sched.waiting) == 1  # q: still no seat
    run_to_completion(sched, model)
    for r in [*decoders, p, q]:
        assert r.output_token_ids == oracle(r, sched), r.request_id


def test_few_decodes_leave_prefill_the_rest_of_the_budget():
    # 3 decodes < budget / 2: the step stays within the budget (8), the prompt gets 5.
    sched, model = make(num_blocks=64, block_size=4, budget=8)
    for i in range(3):
        sched.add_request(req(f"d{i}", [i + 1], max_tokens=10))
    step(sched, model)
    sched.add_request(req("p", list(range(30, 40))))
    out = step(sched, model)
    assert layout(out) == [("d0", 1, 1), ("d1", 1, 1), ("d2", 1, 1), ("p", 0, 5)]
    out = step(sched, model)
    assert layout(out)[3:] == [("p", 5, 5)] and out.total_num_scheduled_tokens == 8


def test_prefill_share_goes_fcfs_to_the_running_chunk_then_waiting_prompts():
    # Budget 4 (share 2) and 5 decodes: the running chunk takes the share first; a prompt's
    # last token is a one-token request like a decode, so it leaves the share to the next.
    sched, model = make(num_blocks=64, block_size=4, budget=4, max_num_seqs=8)
    for i in range(5):
        sched.add_request(req(f"d{i}", [i + 1], max_tokens=10))
    step(sched, model)  # d0..d3 (4 tokens)
    assert layout(step(sched, model))[4:] == [("d4", 0, 1)]  # 4 decodes + share 2 (1 used)
    sched.add_request(req("a", [20, 21, 22]))
    sched.add_request(req("b", [30, 31, 32, 33]))
    sched.add_request(req("c", [40, 41]))
    assert layout(step(sched, model))[5:] == [("a", 0, 2)]
    assert layout(step(sched, model))[5:] == [("a", 2, 1), ("b", 0, 2)]
    out = step(sched, model)
    assert layout(out)[5:] == [("a", 3, 1), ("b", 2, 2)] and out.total_num_scheduled_tokens == 8
    assert layout(step(sched, model))[7:] == [("c", 0, 2)]
