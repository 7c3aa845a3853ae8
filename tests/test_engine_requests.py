"""LLMEngine.add_request is the one place a request is checked: each error is a
ParameterError naming its field; n > 1 engine ids are reserved up front (issue 11,
defects 6 and 7)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxserve import LLM, SamplingParams
from mlxserve.config import EngineConfig
from mlxserve.engine.llm_engine import LLMEngine
from mlxserve.exceptions import ParameterError
from tests.engine_helpers import VOCAB_SIZE, make_tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    _, model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=4)
    return LLM(str(model_dir), num_blocks=64, max_model_len=100).engine


def run_all(engine: LLMEngine) -> dict[str, list[list[int]]]:
    """Step until idle; request id -> token ids of each sample."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    return done


def test_engine_ids_of_n_samples_are_reserved_up_front(engine) -> None:
    n2 = SamplingParams(n=2, max_tokens=3, ignore_eos=True, temperature=0.0)
    engine.add_request("a", [5, 6, 7], n2)  # engine ids "a" and "a#1"
    with pytest.raises(ParameterError) as e:
        engine.add_request("a#1", [5, 6], GREEDY)
    assert str(e.value) == "request_id 'a#1' is already in use (sample 1 of request 'a')"
    assert e.value.parameter == "request_id"
    with pytest.raises(ParameterError, match=r"^request_id 'a' is already in use$"):
        engine.add_request("a", [5], GREEDY)
    engine.add_request("b#1", [5, 6], GREEDY)
    with pytest.raises(ParameterError) as e:
        engine.add_request("b", [5, 6], n2)
    assert str(e.value) == (
        "request_id 'b' with n=2 needs engine id 'b#1', which is already in use"
    )
    done = run_all(engine)
    assert sorted(done) == ["a", "b#1"]
    assert [len(t) for t in done["a"]] == [3, 3] and len(done["b#1"][0]) == 3
    engine.add_request("a#1", [5, 6], GREEDY)  # free again once "a" has finished
    assert len(run_all(engine)["a#1"][0]) == 3
    assert not engine.fanout.parents and not engine.outputs.states


@pytest.mark.parametrize(
    "prompt,params,parameter,message",
    [
        ([], GREEDY, "prompt", "prompt must not be empty"),
        ("", GREEDY, "prompt", "prompt must not be empty"),
        (
            [5, VOCAB_SIZE, -1],
            GREEDY,
            "prompt",
            f"prompt token ids must be in [0, {VOCAB_SIZE}) (the model's vocabulary), "
            f"got [{VOCAB_SIZE}, -1]",
        ),
        (
            [5] * 100,
            GREEDY,
            "prompt",
            "prompt is 100 tokens, but max_model_len is 100: it must be at most 99 tokens "
            "to generate anything",
        ),
        (
            [5] * 20,
            SamplingParams(max_tokens=90),
            "max_tokens",
            "max_tokens 90 + prompt 20 tokens = 110 exceeds max_model_len 100; "
            "use max_tokens <= 80",
        ),
        (
            [5],
            SamplingParams(logit_bias={VOCAB_SIZE + 1: 2.0}),
            "logit_bias",
            f"logit_bias token ids must be in [0, {VOCAB_SIZE}) (the model's vocabulary), "
            f"got [{VOCAB_SIZE + 1}]",
        ),
        (
            [5],
            SamplingParams(stop_token_ids=[7, 5000]),
            "stop_token_ids",
            f"stop_token_ids token ids must be in [0, {VOCAB_SIZE}) (the model's "
            "vocabulary), got [5000]",
        ),
    ],
)
def test_add_request_errors_name_their_parameter(
    engine, prompt, params, parameter, message
) -> None:
    with pytest.raises(ParameterError) as e:
        engine.add_request("x", prompt, params)
    assert (e.value.parameter, str(e.value)) == (parameter, message)
    assert not engine.has_unfinished_requests() and not engine.fanout.parents
    engine.add_request("x", [5, 6], GREEDY)  # nothing of the rejected request is left
    assert len(run_all(engine)["x"][0]) == 3


def test_max_model_len_below_two_is_refused_at_start_up() -> None:
    with pytest.raises(ParameterError) as e:
        EngineConfig(max_model_len=1)
    assert e.value.parameter == "max_model_len"
    assert str(e.value) == ("max_model_len must be >= 2 (1 prompt token + 1 output token), got 1")
    assert EngineConfig(max_model_len=2).max_model_len == 2


@pytest.mark.skipif(mx.metal.is_available(), reason="checks the error where Metal is missing")
def test_metal_kernels_without_metal_are_refused_before_loading(monkeypatch) -> None:
    monkeypatch.setenv("MLXSERVE_KERNELS", "metal")
    with pytest.raises(ParameterError, match=r"kernels='metal'.*is_available\(\) is False") as e:
        LLM("/no/such/model")  # the setting is checked before the model is looked for
    assert e.value.parameter == "kernels"
