"""A request that makes its step fail fails alone: the others in the batch finish with
the tokens they get without it, its blocks are freed, and the engine keeps serving
(issue 11, defect 1). Through LLM.generate and through AsyncLLM (the server's path)."""

from __future__ import annotations

import asyncio
import threading

import mlx.core as mx
import numpy as np
import pytest

from mlxserve import LLM, SamplingParams
from mlxserve.engine.async_llm import AsyncLLM
from mlxserve.exceptions import RequestFailedError
from mlxserve.sampling_params import StructuredOutputsParams
from mlxserve.structured_output.grammar import GrammarState
from mlxserve.worker import model_runner
from tests.engine_helpers import make_tiny_model_dir
from tests.server_harness import wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ATTACKER = 3  # its index among the prompts: bisection has to split a few times to find it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=5)[1]


def victims() -> list[list[int]]:
    """7 prompts of mixed lengths (4..50 tokens), two sharing a 32-token prefix."""
    rng = np.random.default_rng(11)
    shared = rng.integers(3, 300, size=32).tolist()
    out = [rng.integers(3, 300, size=int(n)).tolist() for n in (4, 50, 9, 23, 37)]
    return out + [shared + [7, 8, 9], shared + [10, 11]]


def bad_cast_params(n: int = 1) -> SamplingParams:
    """A logit bias of 2**64, set past validation: the sampler's mx.array(..., float32)
    raises std::bad_cast (as top_k = 2**31 did in issue 11)."""
    params = SamplingParams(temperature=0.0, max_tokens=10, n=n, logit_bias={5: 1.0})
    object.__setattr__(params, "logit_bias", {5: 2**64})
    return params


def marked_params(n: int = 1) -> SamplingParams:
    """A request the injected faults recognise (greedy, like the victims)."""
    return SamplingParams(temperature=0.0, max_tokens=10, n=n, ignore_eos=True, seed=4242)


def is_marked(request) -> bool:
    return request.sampling_params.seed == 4242


def inject(where: str, monkeypatch, llm: LLM):
    """A fault that only steps holding a marked request trigger; returns the attacker params."""
    if where == "launch":  # a real one: the sampler's mx.array raises std::bad_cast
        return bad_cast_params()
    if where == "collect":  # reading the step's results back fails
        real = model_runner.read_part

        def read(part):
            if any(is_marked(r) for r in part.samplers):
                raise RuntimeError("injected fault while reading the step")
            return real(part)

        monkeypatch.setattr(model_runner, "read_part", read)
        return marked_params(n=2)
    if where == "grammar":  # its mask lets through what its grammar then refuses (a bug)
        monkeypatch.setattr(GrammarState, "fill_bitmask", lambda self, row: None)
        choice = StructuredOutputsParams(choice=["Paris"])
        return SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=choice)
    assert where == "output"  # the host side: detokenizing the request's new token
    outputs = llm.engine.outputs
    real_process = outputs.process

    def process(request, *args):
        if is_marked(request) and request.num_output_tokens >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_process(request, *args)

    monkeypatch.setattr(outputs, "process", process)
    return marked_params()


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    assert engine.get_stats().kv_cache_usage == 0
    assert not engine.fanout.parents and not engine.runner._states


@pytest.mark.parametrize("where", ["launch", "collect", "output", "grammar"])
def test_generate_fails_only_the_request_that_breaks_its_step(model_dir, where, monkeypatch):
    llm = LLM(str(model_dir), num_blocks=256, max_num_batched_tokens=32)
    prompts = victims()
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    attacker = inject(where, monkeypatch, llm)
    mixed = prompts[:ATTACKER] + [[5, 6, 7, 8, 9]] + prompts[ATTACKER:]
    params = [GREEDY] * len(mixed)
    params[ATTACKER] = attacker
    outs = llm.generate(mixed, params, use_tqdm=False)
    bad = outs.pop(ATTACKER)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outs)
    assert bad.finished and bad.error.startswith("internal error while running this request")
    assert {c.finish_reason for c in bad.outputs} == {"error"}
    expected = {"launch": "bad_cast", "collect": "injected fault", "output": "injected"}
    assert (expected | {"grammar": "the output constraint rejected token"})[where] in bad.error
    assert_idle(llm)
    monkeypatch.undo()  # and it keeps serving
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference


def test_async_llm_fails_only_the_attacker(model_dir) -> None:
    llm = LLM(str(model_dir), num_blocks=256, max_num_batched_tokens=32)
    prompts = victims()
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    engine = AsyncLLM(llm.engine)

    async def run(rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(rid, None, params, prompt_token_ids=prompt):
            tokens += out.outputs[0].token_ids
        return tokens

    async def main():
        jobs = [run(f"v{i}", p, GREEDY) for i, p in enumerate(prompts)]
        jobs.insert(ATTACKER, run("attacker", [5, 6, 7, 8, 9], bad_cast_params(n=2)))
        return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 120)

    try:
        results = asyncio.run(main())
        error = results.pop(ATTACKER)
        assert results == reference
        assert isinstance(error, RequestFailedError) and error.request_id == "attacker"
        assert str(error).startswith("internal error while running this request: ")
        assert "bad_cast" in str(error)
        assert asyncio.run(run("after", prompts[0], GREEDY)) == reference[0]
        # The engine thread finishes its last (empty) step on its own.
        assert wait_until(lambda: not llm.engine.has_unfinished_requests(), timeout=30)
    finally:
        engine.shutdown()
    assert_idle(llm)


def test_a_lost_kv_pool_fails_every_request_then_serves_from_a_fresh_pool(
    model_dir, monkeypatch
) -> None:
    """When even the pool cannot be evaluated after a failed step, nothing in it can be
    trusted: every request fails, the cached prefixes are forgotten, a new pool is made."""
    llm = LLM(str(model_dir), num_blocks=256, max_num_batched_tokens=32)
    prompts = victims()
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm.engine.block_pool.num_cached_blocks > 0
    runner = llm.engine.runner
    real = model_runner.read_part

    def read(part):
        monkeypatch.setattr(model_runner, "read_part", real)  # once
        # An array made lazily on another thread cannot be evaluated on this one.
        box = []
        shape = runner.kv_cache.keys[0].shape
        t = threading.Thread(target=lambda: box.append(mx.zeros(shape, runner.dtype) + 1))
        t.start()
        t.join()
        runner.kv_cache.keys[0] = box[0]
        ahead = llm.engine._in_flight  # async scheduling: the step built on this one
        if ahead is not None and ahead[1].before is not None:
            ahead[1].before.keys[0] = box[0]  # the pool its re-runs would start from
        raise RuntimeError("injected fault")

    monkeypatch.setattr(model_runner, "read_part", read)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "error" for o in outs)
    assert all("KV cache could not be evaluated" in o.error for o in outs)
    assert_idle(llm)
    assert llm.engine.block_pool.num_cached_blocks == 0  # those blocks' contents are gone
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference


def test_a_fault_no_request_causes_alone_fails_nobody(model_dir) -> None:
    """Issue 11's top_k = 2**31 breaks the sampler only next to a request that uses top-k
    (then the top_k column is built): run apart, both work, so nobody is failed."""
    llm = LLM(str(model_dir), num_blocks=256, max_num_batched_tokens=32)
    prompts = victims()
    seeded = [
        SamplingParams(temperature=1.0, top_k=20, seed=i, max_tokens=10, ignore_eos=True)
        for i in range(len(prompts))
    ]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
    attacker = SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8, 9]], attacker, use_tqdm=False)[0].outputs[0].token_ids
    object.__setattr__(attacker, "top_k", 2**31)  # >= vocab: no top-k for this row
    outs = llm.generate([*prompts, [5, 6, 7, 8, 9]], [*seeded, attacker], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [*reference, alone]
    assert all(o.error is None for o in outs)
    assert_idle(llm)


def test_a_broken_group_the_engine_cannot_report_still_fails_its_callers(
    model_dir, monkeypatch
) -> None:
    """A rank died and rank 0's step never returns (MLX's ring can leave a collective
    blocked for good: seen under CI load). The rank watchdog ends the process, but first
    every caller still waiting gets the reason (before: a dropped stream, no error)."""
    from types import SimpleNamespace

    from mlxserve.worker import launch

    llm = LLM(str(model_dir), num_blocks=64)
    engine = llm.engine
    entered, release = threading.Event(), threading.Event()

    def hung_step(*args, **kwargs):  # a collective on a broken ring
        entered.set()
        release.wait(60)
        raise RuntimeError("released at the end of the test")

    monkeypatch.setattr(engine, "step", hung_step)
    monkeypatch.setattr(engine, "ranks", SimpleNamespace(before_exit=None))
    exits: list[int] = []
    monkeypatch.setattr(launch.os, "_exit", exits.append)
    monkeypatch.setattr(launch, "FLUSH_SECONDS", 0.0)
    async_llm = AsyncLLM(engine)

    async def consume() -> list[int]:
        tokens: list[int] = []
        async for out in async_llm.generate("r", None, GREEDY, prompt_token_ids=[5, 6, 7]):
            tokens += out.outputs[0].token_ids
        return tokens

    async def main() -> BaseException | list[int]:
        task = asyncio.create_task(consume())
        assert await asyncio.to_thread(entered.wait, 30)
        why = "rank 1 exited (killed by signal 9)"
        await asyncio.to_thread(launch.exit_lost, "tensor parallel", why, engine.ranks.before_exit)
        done, _ = await asyncio.wait([task], timeout=30)
        assert done, "the caller was left waiting"
        return task.exception() or task.result()

    try:
        error = asyncio.run(main())
        assert isinstance(error, RuntimeError), error
        assert "tensor parallel: a rank is gone (rank 1 exited (killed by signal 9))" in str(error)
        assert exits == [1]
    finally:
        engine.ranks = None
        release.set()
        async_llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_step_after_a_failed_one_is_fed_the_tokens_its_re_run_reports(
    model_dir, monkeypatch, async_scheduling
) -> None:
    """Async scheduling builds step N+1 on N's sampled tokens before N is read. If reading
    N fails, N is re-run in parts, and those parts' tokens are the ones reported: N+1 must
    be fed them, not the failed graph's. Here the failed graph's tokens are made wrong on
    purpose (as a near tie under another batch, or a sampler that failed, would make
    them): the victims' outputs must still be the reference's."""
    llm = LLM(
        str(model_dir),
        num_blocks=256,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
    )
    prompts = victims()
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    vocab = llm.engine.vocab_size
    real_build, real_read = model_runner.build_part, model_runner.read_part
    poisoned: list[int] = []

    def build(so, **kwargs):
        part = real_build(so, **kwargs)
        if not poisoned and any(is_marked(r) for r in part.samplers):
            poisoned.append(len(part.samplers))  # the first graph holding the attacker
            part.result.token_ids = (part.result.token_ids + 1) % vocab
        return part

    def read(part):
        if any(is_marked(r) for r in part.samplers):
            raise RuntimeError("injected fault while reading the step")
        return real_read(part)

    monkeypatch.setattr(model_runner, "build_part", build)
    monkeypatch.setattr(model_runner, "read_part", read)
    mixed = prompts[:ATTACKER] + [[5, 6, 7, 8, 9]] + prompts[ATTACKER:]
    params = [GREEDY] * len(mixed)
    params[ATTACKER] = marked_params()
    outs = llm.generate(mixed, params, use_tqdm=False)
    assert poisoned and poisoned[0] > 1  # the poisoned step sampled for victims too
    bad = outs.pop(ATTACKER)
    assert bad.error is not None and "injected fault" in bad.error
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.error is None for o in outs)
    assert_idle(llm)
