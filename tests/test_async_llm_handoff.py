"""Outputs reach callers without delay: AsyncLLM hands a step's outputs to each event loop
in one wakeup, not one per request; a step returns the token it computed.

Before, every output of a step was its own ``call_soon_threadsafe`` (a self-pipe write and
a callback on the loop): 32 streams woke the server's loop 32 times per step. The tokens
each caller gets are checked against LLM.generate (the same engine, synchronous).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from mlxserve import LLM, SamplingParams
from mlxserve.engine.async_llm import AsyncLLM
from tests.engine_helpers import make_tiny_model_dir

PROMPTS = [[5, 6, 7 + i, 9, 10 + 2 * i] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=3)[1]
    return LLM(str(model_dir), num_blocks=64)


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


async def _collect(engine: AsyncLLM, rid: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(rid, None, GREEDY, prompt_token_ids=prompt):
        tokens += out.outputs[0].token_ids
    return tokens


def test_one_wakeup_per_step_for_all_streams(llm, reference, monkeypatch) -> None:
    steps = 0
    real_step = llm.engine.step

    def counted_step(*args, **kwargs):
        nonlocal steps
        outputs = real_step(*args, **kwargs)
        steps += 1
        return outputs

    monkeypatch.setattr(llm.engine, "step", counted_step)
    engine = AsyncLLM(llm.engine)
    wakeups = 0

    async def main() -> list[list[int]]:
        nonlocal wakeups
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            nonlocal wakeups
            if threading.current_thread() is engine._thread:  # the engine thread's handoffs
                wakeups += 1
            return real(*args, **kwargs)

        loop.call_soon_threadsafe = counted
        jobs = [_collect(engine, f"r{i}", p) for i, p in enumerate(PROMPTS)]
        return await asyncio.wait_for(asyncio.gather(*jobs), 120)

    try:
        assert asyncio.run(main()) == reference
    finally:
        engine.shutdown()
    # 6 streams x 6 tokens: one wakeup per output was >= 36 wakeups over ~8 steps.
    assert 0 < wakeups <= steps < len(PROMPTS) * GREEDY.max_tokens
    assert (engine.num_steps, engine.num_handoffs) == (steps, wakeups)


def test_streams_on_two_event_loops_each_get_their_outputs(llm, reference) -> None:
    """A step whose outputs go to two loops (two threads) wakes each with its own items."""
    engine = AsyncLLM(llm.engine)
    results: dict[int, list[list[int]]] = {}
    start = threading.Barrier(2)

    def run(k: int) -> None:
        mine = range(k, len(PROMPTS), 2)

        async def main() -> list[list[int]]:
            start.wait(timeout=30)  # both loops' requests in the same steps
            jobs = [_collect(engine, f"t{k}-{i}", PROMPTS[i]) for i in mine]
            return await asyncio.wait_for(asyncio.gather(*jobs), 120)

        results[k] = asyncio.run(main())

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=150)
    finally:
        engine.shutdown()
    assert results[0] == reference[0::2]
    assert results[1] == reference[1::2]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_step_returns_the_token_it_computed(
    llm, reference, async_scheduling, monkeypatch
) -> None:
    """step() returns the outputs of the step it collects: each call returns its own token,
    the first call included, with steps scheduled ahead too (the Metal-only "pipelined"
    order this replaced returned each token one call late, the first call nothing)."""
    engine = llm.engine
    monkeypatch.setattr(engine, "async_scheduling", async_scheduling)
    engine.add_request("one", None, GREEDY, prompt_token_ids=PROMPTS[0])
    tokens = []
    for _ in range(GREEDY.max_tokens):
        (out,) = engine.step(delta=True)
        assert len(out.outputs[0].token_ids) == 1
        tokens += out.outputs[0].token_ids
    assert out.finished and tokens == reference[0]
    assert not engine.has_unfinished_requests()
