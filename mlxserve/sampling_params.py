"""SamplingParams: how one request picks its tokens, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Per-request sampling settings, named and defaulted as in vLLM.

    Every field is checked in ``__post_init__``; a bad value raises ``ValueError``
    naming the field, the value and the allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Filled by the engine: extra eos ids from generation_config etc. Not user-facing.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        _check_int("n", self.n, lo=1)
        _check_number("temperature", self.temperature, lo=0.0)
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=0)
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
        _check_number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}"
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(
                    f"logit_bias must be a dict of token id -> bias, got "
                    f"{type(self.logit_bias).__name__}"
                )
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    tok = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
                _check_int("logit_bias token id", tok, lo=0)
                _check_number(f"logit_bias[{tok}]", v, lo=-100.0, hi=100.0)
                bias[tok] = float(v)
            self.logit_bias = bias

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def num_logprobs(self) -> int:
        """How many top logprobs to return per sampled token (0 = none)."""
        return self.logprobs or 0


def _check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _check_number(
    name: str,
    value: object,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
