"""SamplingParams: how one request picks its tokens, validated at construction.

Every number is bounded by what the engine can hold: the sampler builds int32 and float32
MLX arrays from these fields (top_k, logit bias ids and values, stop token ids, penalties),
token counts are int32 positions, and a seed is 64 bits. A value past those ranges is a
ParameterError naming the field here, before it can reach a batch it would break.
"""

from __future__ import annotations

import math
from dataclasses import Field, dataclass, field, fields
from functools import cache
from typing import Any

from mlxserve.exceptions import ParameterError
from mlxserve.structured_output.params import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]

MAX_LOGPROBS = 20
# Per-request limits (docs/serving.md "Limits"): each caps work a single request adds to every step.
MAX_N = 128  # samples per prompt, as OpenAI's n
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_STOP = 64  # stop strings (each is searched in every new piece of text)
MAX_STOP_TOKEN_IDS = 1024

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32: below it a value may round to 0


def reads_host_tokens(default: Any) -> Any:
    """A field whose non-default value needs the request's previous token on the host before
    its next step is built (it reads the output tokens: penalties count them), so async
    scheduling never builds that step ahead. Fields not marked work on the device's tokens."""
    return field(default=default, metadata={"reads_host_tokens": True})


@dataclass
class SamplingParams:
    """Per-request sampling settings, named and defaulted as in vLLM.

    Every field is checked in ``__post_init__``; a bad value raises ``ParameterError`` (a
    ``ValueError``) whose ``parameter`` is the field and whose message gives the value and the
    allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = reads_host_tokens(0.0)
    frequency_penalty: float = reads_host_tokens(0.0)
    repetition_penalty: float = reads_host_tokens(1.0)
    logit_bias: dict[int, float] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = reads_host_tokens(None)  # reported with the first token
    skip_special_tokens: bool = True
    # Constrain the output (JSON schema, regex, choice, grammar); compiled by the engine.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine: extra eos ids from generation_config etc. Not user-facing.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def needs_host_tokens(self) -> bool:
        """Whether a field marked with :func:`reads_host_tokens` is not at its default."""
        return any(getattr(self, f.name) != f.default for f in _host_token_fields())

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        _check_int("n", self.n, lo=1, hi=MAX_N)
        _check_float("temperature", self.temperature, lo=0.0)
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=0, hi=INT32_MAX)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=INT64_MIN, hi=INT64_MAX)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1, hi=INT32_MAX)
        _check_int("min_tokens", self.min_tokens, lo=0, hi=INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}",
                parameter="min_tokens",
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        _check_count("stop", self.stop, MAX_STOP)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ParameterError(
                    f"stop must be a list of non-empty strings, got {s!r}", parameter="stop"
                )
        _check_count("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0, hi=INT32_MAX)
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ParameterError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}",
                parameter="structured_outputs",
            )

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def num_logprobs(self) -> int:
        """How many top logprobs to return per sampled token (0 = none)."""
        return self.logprobs or 0


def _checked_logit_bias(logit_bias: object) -> dict[int, float]:
    """{token id: bias} with int keys; ids are int32, biases in [-100, 100]."""
    if not isinstance(logit_bias, dict):
        raise ParameterError(
            f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}",
            parameter="logit_bias",
        )
    _check_count("logit_bias", logit_bias, MAX_LOGIT_BIAS, what="entries")
    bias = {}
    for key, value in logit_bias.items():
        tok = _token_id_key(key)
        _check_float(f"logit_bias[{tok}]", value, lo=-100.0, hi=100.0, parameter="logit_bias")
        bias[tok] = float(value)
    return bias


def _token_id_key(key: object) -> int:
    # JSON object keys are strings: accept "123" (ASCII digits only) and ints.
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key <= INT32_MAX:
        raise ParameterError(
            f"logit_bias keys must be token ids (integers in [0, {INT32_MAX}]), got {_show(key)}",
            parameter="logit_bias",
        )
    return key


def _as_list(name: str, value: object) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ParameterError(f"{name} must be a list, got {type(value).__name__}", parameter=name)
    return list(value)


def _check_count(name: str, items: list | dict, limit: int, what: str = "items") -> None:
    if len(items) > limit:
        raise ParameterError(
            f"{name} has {len(items)} {what}; at most {limit} are allowed", parameter=name
        )


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParameterError(f"{name} must be an integer, got {_show(value)}", parameter=name)
    if value < lo:
        raise ParameterError(f"{name} must be >= {lo}, got {_show(value)}", parameter=name)
    if value > hi:
        raise ParameterError(f"{name} must be <= {hi}, got {_show(value)}", parameter=name)


def _check_float(
    name: str,
    value: object,
    lo: float,
    hi: float = FLOAT32_MAX,
    lo_open: bool = False,
    parameter: str | None = None,
) -> None:
    """A finite number in [lo, hi] (lo excluded if ``lo_open``) that float32 holds."""
    parameter = parameter or name
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParameterError(f"{name} must be a number, got {_show(value)}", parameter=parameter)
    if isinstance(value, float) and not math.isfinite(value):
        raise ParameterError(f"{name} must be a finite number, got {value}", parameter=parameter)
    if value < lo or (lo_open and value == lo):
        op = ">" if lo_open else ">="
        raise ParameterError(f"{name} must be {op} {lo}, got {_show(value)}", parameter=parameter)
    if value > hi:
        raise ParameterError(f"{name} must be <= {hi:g}, got {_show(value)}", parameter=parameter)
    if lo_open and value < FLOAT32_TINY:  # would round to the excluded bound in float32
        raise ParameterError(
            f"{name} must be > {lo} (at least {FLOAT32_TINY:.4g}, the smallest float32), "
            f"got {value}",
            parameter=parameter,
        )


def _show(value: object) -> str:
    """A value for an error message, short even for a huge int or string."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@cache
def _host_token_fields() -> tuple[Field, ...]:
    return tuple(f for f in fields(SamplingParams) if f.metadata.get("reads_host_tokens"))
