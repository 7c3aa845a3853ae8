"""Async scheduling gives the outputs of the synchronous engine: greedy and seeded samples
token for token, logprobs, EOS / stop tokens / stop strings / max_tokens, min_tokens, n > 1,
chunked prompts, preemption in a tiny pool, aborts mid-stream, AsyncLLM streams.

The oracle is the same engine with ``async_scheduling=False`` (itself checked against
mlx-lm and llama.cpp elsewhere). Each test also counts the steps launched ahead (before
the previous step's tokens reached the host), so it fails if async scheduling silently
never happens, or happens while a request needs its tokens on the host.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mlxserve import LLM, SamplingParams
from mlxserve.engine.async_llm import AsyncLLM
from tests.engine_helpers import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=9)[1]


def prompts(n: int = 10, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, size=int(k)).tolist() for k in rng.integers(3, 40, size=n)]


def make_llm(model_dir, async_scheduling: bool, **kwargs) -> LLM:
    """An LLM whose runner counts the steps launched ahead (in ``llm.num_ahead``)."""
    llm = LLM(str(model_dir), async_scheduling=async_scheduling, **kwargs)
    runner = llm.engine.runner
    launch = runner.launch
    llm.num_ahead = 0
    llm.num_ahead_while_sync = 0  # ... while a request needing host tokens was live

    def counting_launch(so, previous=None, start=True):
        if so.placeholder_request_ids:
            llm.num_ahead += 1
            llm.num_ahead_while_sync += bool(llm.engine.scheduler.sync_request_ids)
        return launch(so, previous, start)

    runner.launch = counting_launch
    return llm


def pair(model_dir, **kwargs) -> tuple[LLM, LLM]:
    return make_llm(model_dir, True, **kwargs), make_llm(model_dir, False, **kwargs)


def summary(outs) -> list:
    """Everything a caller sees of each output, logprobs apart (see same_outputs)."""
    return [
        (
            o.prompt_token_ids,
            [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs],
            o.finished,
            o.error,
        )
        for o in outs
    ]


def same_logprobs(got, want) -> bool:
    """The same entries (token ids) with the same logprobs to float32 rounding: a step's
    batch may differ by a row (a sibling sample admitted a step later, a finished
    request's discarded extra row), and the CPU's matmuls round differently per batch."""
    if got is None or want is None:
        return got is want
    return len(got) == len(want) and all(
        g.keys() == w.keys() and all(abs(g[t] - w[t]) <= 1e-4 for t in w)
        for g, w in zip(got, want, strict=True)
    )


def assert_same_outputs(got, want) -> None:
    assert summary(got) == summary(want)
    for g, w in zip(got, want, strict=True):
        for cg, cw in zip(g.outputs, w.outputs, strict=True):
            assert same_logprobs(cg.logprobs, cw.logprobs), (cg.logprobs, cw.logprobs)


def test_greedy_seeded_logprobs_n2_min_tokens_and_chunks_match_sync(model_dir) -> None:
    ps = prompts(13)
    first = make_llm(model_dir, False)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # A token each prompt's greedy output holds 4th: a stop token it meets.
    stop = [o.outputs[0].token_ids[3] for o in first.generate(ps, greedy, False)]
    (eos,) = first.engine.eos_token_ids
    big6, big_eos = {stop[6]: 100.0}, {eos: 100.0}
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=14, logprobs=3),
        SamplingParams(temperature=1.0, top_k=20, seed=8, max_tokens=10, n=2),
        SamplingParams(temperature=0.8, seed=9, max_tokens=10, min_p=0.05),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop[5]]),
        # min_tokens masks the stop token (the count includes a token in flight), then it wins.
        SamplingParams(
            temperature=0, max_tokens=12, stop_token_ids=[stop[6]], min_tokens=5, logit_bias=big6
        ),
        SamplingParams(temperature=1.0, seed=10, max_tokens=12, stop_token_ids=[stop[7]]),
        SamplingParams(temperature=0, max_tokens=8, logit_bias={stop[8]: 3.0}),
        SamplingParams(temperature=1.0, seed=4, max_tokens=12, min_tokens=3, logit_bias=big_eos),
        SamplingParams(temperature=0.7, seed=11, max_tokens=12, min_tokens=6, logprobs=0),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.6, seed=12, max_tokens=7, n=3, logprobs=1),
    ]
    for kwargs in (dict(num_blocks=256), dict(num_blocks=256, max_num_batched_tokens=16)):
        fast, slow = pair(model_dir, **kwargs)
        want = slow.generate(ps, params, use_tqdm=False)
        got = fast.generate(ps, params, use_tqdm=False)
        assert_same_outputs(got, want)
        assert fast.num_ahead > 0 and slow.num_ahead == 0
        reasons = [o.outputs[0].finish_reason for o in want]
        assert reasons.count("stop") >= 3 and reasons.count("length") >= 3
        assert len(want[6].outputs[0].token_ids) == 6 and want[6].outputs[0].stop_reason == stop[6]
        assert len(want[9].outputs[0].token_ids) == 4 and reasons[9] == "stop"  # EOS
        assert want[9].outputs[0].stop_reason is None
        assert not fast.engine.has_unfinished_requests()
        kv = fast.engine.scheduler.kv_cache_manager
        assert kv.usage == 0.0 and len(fast.engine.runner._states) == 0


def test_stop_strings_match_sync(model_dir) -> None:
    """Stop strings are found on the host after the next step was launched: the extra
    token computed for the finished request never shows."""
    ps = prompts(8, seed=5)
    fast, slow = pair(model_dir, num_blocks=256)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    texts = [o.outputs[0].text for o in slow.generate(ps, greedy, use_tqdm=False)]
    params = []
    for i, text in enumerate(texts):
        stop = text[4 + i % 5 : 6 + i % 5] or "zz"  # a string the output holds mid-way
        include = i % 2 == 0
        params.append(
            SamplingParams(
                temperature=0, max_tokens=16, stop=[stop], include_stop_str_in_output=include
            )
        )
    want = slow.generate(ps, params, use_tqdm=False)
    got = fast.generate(ps, params, use_tqdm=False)
    assert_same_outputs(got, want)
    assert sum(o.outputs[0].stop_reason is not None for o in want) >= 4
    assert fast.num_ahead > 0


def test_preemption_in_a_tiny_pool_matches_sync(model_dir) -> None:
    """24 blocks x 16 tokens cannot hold 24 running requests: requests are preempted,
    some while their token is in flight, and recompute."""
    ps = [p * 3 for p in prompts(24, seed=8)]
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, max_tokens=16, ignore_eos=True),
    ]
    fast, slow = pair(model_dir, num_blocks=24, max_model_len=256)
    want = slow.generate(ps, params * 12, use_tqdm=False)
    got = fast.generate(ps, params * 12, use_tqdm=False)
    assert_same_outputs(got, want)
    assert fast.engine.scheduler.make_stats().num_preemptions > 0
    assert fast.num_ahead > 0
    assert fast.engine.scheduler.kv_cache_manager.usage == 0.0


def test_abort_mid_stream_with_a_step_in_flight(model_dir) -> None:
    """A request aborted while the step ahead computes it: its tokens so far are those of
    the synchronous run, nothing more is reported for it, the others are unaffected and
    every block is free in the end."""
    ps = prompts(4, seed=11)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    fast, slow = pair(model_dir, num_blocks=128)
    want = {o.request_id: o.outputs[0].token_ids for o in slow.generate(ps, params, False)}
    engine = fast.engine
    for i, p in enumerate(ps):
        engine.add_request(str(i), None, params, prompt_token_ids=p)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
    finished = set()
    for step in range(40):
        if not engine.has_unfinished_requests():
            break
        if step == 4:
            assert engine._in_flight is not None  # a step ahead holds request 1
            (final,) = engine.abort_request("1")
            assert final.finished and final.outputs[0].finish_reason == "abort"
            finished.add("1")
        for out in engine.step(delta=True):
            assert out.request_id not in finished
            got[out.request_id] += out.outputs[0].token_ids
            if out.finished:
                finished.add(out.request_id)
    # LLM.generate numbers its requests from 0 as this loop did.
    for rid, tokens in got.items():
        if rid == "1":
            assert 0 < len(tokens) < 12 and tokens == want[rid][: len(tokens)]
        else:
            assert tokens == want[rid]
    assert engine.scheduler.kv_cache_manager.usage == 0.0
    assert len(engine.runner._states) == 0


def test_a_request_needing_host_tokens_runs_its_steps_in_order(model_dir) -> None:
    """Penalties count the previous tokens on the host: while such a request is live no
    step is launched ahead; outputs match sync, and other requests are scheduled ahead
    once it has finished."""
    ps = prompts(4, seed=13)
    params = [
        SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=2, max_tokens=4, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
    ]
    fast, slow = pair(model_dir, num_blocks=128)
    want = slow.generate(ps, params, use_tqdm=False)
    got = fast.generate(ps, params, use_tqdm=False)
    assert_same_outputs(got, want)
    assert fast.num_ahead > 0 and fast.num_ahead_while_sync == 0
    assert not fast.engine.scheduler.sync_request_ids


def test_async_llm_streams_match_sync(model_dir) -> None:
    """The server's path: AsyncLLM's engine thread steps ahead; each stream's tokens are
    those of the synchronous LLM.generate."""
    ps = prompts(6, seed=17)
    params = SamplingParams(temperature=0.7, seed=21, max_tokens=10, logprobs=1)
    fast, slow = pair(model_dir, num_blocks=128)
    want = [o.outputs[0] for o in slow.generate(ps, params, use_tqdm=False)]
    engine = AsyncLLM(fast.engine)

    async def stream(i: int) -> tuple[list[int], list]:
        tokens, logprobs = [], []
        async for out in engine.generate(f"s{i}", None, params, prompt_token_ids=ps[i]):
            tokens += out.outputs[0].token_ids
            logprobs += out.outputs[0].logprobs or []
        return tokens, logprobs

    async def main():
        return await asyncio.gather(*(stream(i) for i in range(len(ps))))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [r[0] for r in results] == [w.token_ids for w in want]
    for r, w in zip(results, want, strict=True):
        assert same_logprobs(r[1], w.logprobs)
    assert fast.num_ahead > 0


def test_the_flag_reaches_the_engine(model_dir) -> None:
    """async_scheduling is on by default; LLM(async_scheduling=False) and the CLI's
    --no-async-scheduling turn it off (vLLM's flag)."""
    from mlxserve.cli.engine_args import add_engine_args, engine_config

    assert LLM(str(model_dir), num_blocks=32).engine.async_scheduling
    assert not LLM(str(model_dir), num_blocks=32, async_scheduling=False).engine.async_scheduling
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args([]), None).async_scheduling
    off = parser.parse_args(["--no-async-scheduling"])
    assert not engine_config(off, None).async_scheduling


def test_steps_scheduled_ahead_write_the_kv_pool_in_place(model_dir) -> None:
    """MLX decides at dispatch whether a pool write reuses its input's buffer: a step
    dispatched while the previous one still runs copied every pool array. The engine
    dispatches the step ahead once the previous one is collected, so the memory never
    holds a second copy of a pool array, and the runner's watch sees no copy."""
    import mlx.core as mx

    llm = make_llm(model_dir, True, num_blocks=512)
    engine, runner = llm.engine, llm.engine.runner
    runner.pool_watch.every = 1  # compare every step
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts(3, seed=19)):
        engine.add_request(str(i), None, params, prompt_token_ids=p)
    for _ in range(4):  # prefills done, the pool made
        engine.step()
    pool = max(a.nbytes for a in runner.kv_cache.arrays())
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert llm.num_ahead >= steps - 2 >= 30
    assert mx.get_peak_memory() - base < pool
    assert runner.pool_watch.num_copied_steps == 0 and runner.pool_watch._calls >= 30
