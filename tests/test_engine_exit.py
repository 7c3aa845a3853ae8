"""A process that served requests on the engine thread exits with status 0.

MLX asks every thread that used it to free its streams before it ends (the main thread's
are freed at exit). Without that, about 1 exit in 4 of such a process aborted in MLX's C++
teardown (SIGABRT); `mlxserve serve` then ended a clean shutdown with status -6. Each run
below is a fresh process, so a regression shows in 16 runs with ~99% probability.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.engine_helpers import make_tiny_model_dir

PROBE = textwrap.dedent(
    """
    import asyncio, sys
    from mlxserve import LLM, SamplingParams
    from mlxserve.engine.async_llm import AsyncLLM

    llm = LLM(sys.argv[1], num_blocks=64)
    engine = AsyncLLM(llm.engine)
    params = SamplingParams(max_tokens=8, temperature=0)

    async def run(i):
        async for _ in engine.generate(f"r{i}", None, params, prompt_token_ids=[5, 6, 7 + i]):
            pass

    async def main():
        await asyncio.gather(*(run(i) for i in range(4)))

    asyncio.run(main())
    engine.shutdown()
    print("served")
    """
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=2)[1]


def test_exit_after_serving_on_the_engine_thread_is_clean(model_dir) -> None:
    codes = []
    for _ in range(16):
        p = subprocess.run(
            [sys.executable, "-c", PROBE, str(model_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "served" in p.stdout, p.stderr[-2000:]
        codes.append(p.returncode)
    assert codes == [0] * 16, codes
