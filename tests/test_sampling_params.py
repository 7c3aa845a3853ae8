"""SamplingParams bounds: each field is held to what the engine's arrays hold, and the
error names it (ParameterError.parameter), so one request cannot break a batch.

The oracle for "what the arrays hold" is MLX itself: the largest accepted values are run
through the real sampler in a batch, and one past them is refused by mx.array.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.exceptions import ParameterError
from mlxserve.sampling_params import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from mlxserve.worker.sampler import SamplingState, make_sampling_batch, sample

BAD = [
    # (fields, the parameter named, a piece of the message)
    (dict(top_k=2**31), "top_k", f"<= {INT32_MAX}"),
    (dict(seed=2**63), "seed", f"<= {INT64_MAX}"),
    (dict(seed=-(2**63) - 1), "seed", f">= {INT64_MIN}"),
    (dict(seed=10**400), "seed", "an integer of 1329 bits"),
    (dict(n=MAX_N + 1), "n", f"<= {MAX_N}"),
    (dict(n=True), "n", "must be an integer"),
    (dict(max_tokens=2**31), "max_tokens", f"<= {INT32_MAX}"),
    (dict(max_tokens=None, min_tokens=2**31), "min_tokens", f"<= {INT32_MAX}"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens", "min_tokens must be <= max_tokens"),
    (dict(logprobs=21), "logprobs", "<= 20"),
    (dict(prompt_logprobs=-1), "prompt_logprobs", ">= 0"),
    (dict(temperature=float("inf")), "temperature", "finite"),
    (dict(temperature=float("nan")), "temperature", "finite"),
    (dict(temperature=1e39), "temperature", "<= 3.40282e+38"),
    (dict(temperature=10**400), "temperature", "<= 3.40282e+38"),
    (dict(top_p=1e-300), "top_p", "smallest float32"),
    (dict(repetition_penalty=1e-300), "repetition_penalty", "smallest float32"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty", "finite"),
    (dict(presence_penalty=True), "presence_penalty", "must be a number"),
    (dict(logit_bias={2**31: 1.0}), "logit_bias", "token ids"),
    (dict(logit_bias={"-1": 1.0}), "logit_bias", "token ids"),
    (dict(logit_bias={"1_000": 1.0}), "logit_bias", "token ids"),
    (dict(logit_bias={"9" * 5000: 1.0}), "logit_bias", "token ids"),
    (dict(logit_bias={True: 1.0}), "logit_bias", "token ids"),
    (dict(logit_bias={5: float("inf")}), "logit_bias", "logit_bias[5] must be a finite"),
    (dict(logit_bias={5: 101}), "logit_bias", r"logit_bias[5] must be <= 100"),
    (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias", "at most"),
    (dict(logit_bias=[1, 2]), "logit_bias", "must be a dict"),
    (dict(stop_token_ids=[2**31]), "stop_token_ids", f"<= {INT32_MAX}"),
    (dict(stop_token_ids=[-1]), "stop_token_ids", ">= 0"),
    (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids", "at most"),
    (dict(stop_token_ids=5), "stop_token_ids", "must be a list"),
    (dict(stop=["x"] * (MAX_STOP + 1)), "stop", "at most"),
    (dict(stop=[""]), "stop", "non-empty strings"),
]


@pytest.mark.parametrize("fields,parameter,message", BAD)
def test_out_of_range_values_name_their_field(fields: dict, parameter: str, message: str) -> None:
    with pytest.raises(ParameterError) as info:
        SamplingParams(**fields)
    assert info.value.parameter == parameter
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still do


def test_one_past_the_int32_bound_is_what_mlx_cannot_hold() -> None:
    # Why top_k, token ids and counts stop at INT32_MAX: the sampler's int32 arrays refuse
    # the next value (issue 11: "top_k": 2147483648 raised std::bad_cast inside a step).
    # (seed is int64 as in OpenAI's API; the sampler folds it into a 63-bit key.)
    mx.array([INT32_MAX], dtype=mx.int32)
    with pytest.raises(Exception):  # noqa: B017 -- std::bad_cast surfaces as a generic error
        mx.array([INT32_MAX + 1], dtype=mx.int32)


def test_the_largest_accepted_values_run_in_a_batch() -> None:
    vocab = 16
    edge = SamplingParams(
        temperature=3.0e38,
        top_k=INT32_MAX,
        top_p=1.1754943508222875e-38,
        seed=INT64_MAX,
        logit_bias={INT32_MAX: 100.0, 3: -100.0},
        stop_token_ids=[INT32_MAX],
        min_tokens=INT32_MAX,
        max_tokens=INT32_MAX,
        repetition_penalty=3.0e38,
        logprobs=20,
    )
    low = SamplingParams(seed=INT64_MIN, top_k=5, temperature=1.0, logprobs=2)
    states = [
        SamplingState(edge, edge.seed, [1, 2, 3], stop_ids=frozenset(edge.stop_token_ids)),
        SamplingState(low, low.seed, [4]),
    ]
    logits = mx.array(np.random.default_rng(0).standard_normal((2, vocab)), dtype=mx.float32)
    out = sample(logits, make_sampling_batch(states, vocab))
    mx.eval(out.token_ids, out.logprobs)
    tokens = np.array(out.token_ids).tolist()
    assert all(0 <= t < vocab for t in tokens)
    assert tokens[0] != 3  # its -100 bias applies


def test_limits_accept_their_edges() -> None:
    p = SamplingParams(
        n=MAX_N,
        logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS)},
        stop=["s"] * MAX_STOP,
        stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
        top_k=-1,
    )
    assert p.top_k == 0 and len(p.logit_bias) == MAX_LOGIT_BIAS
    assert all(isinstance(k, int) and isinstance(v, float) for k, v in p.logit_bias.items())


@pytest.mark.parametrize(
    ("changed", "needs"),
    [
        ({}, False),
        ({"repetition_penalty": 1.1}, True),  # counts the prompt's and output's tokens
        ({"presence_penalty": 0.5}, True),  # counts the output's tokens
        ({"frequency_penalty": -0.5}, True),
        ({"prompt_logprobs": 0}, True),  # reported with the first token
        # these work on the tokens still on the device: steps may be built ahead
        ({"temperature": 0.3, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 7}, False),
        ({"logit_bias": {3: 1.0}, "min_tokens": 4, "logprobs": 2, "stop": ["x"]}, False),
    ],
)
def test_which_fields_keep_a_request_off_async_scheduling(changed: dict, needs: bool) -> None:
    assert SamplingParams(**changed).needs_host_tokens() is needs
