"""Engine outputs -> OpenAI response pieces: usage, logprobs (chat and completions formats).

The engine's logprobs entry for one position is {token_id: logprob} holding the chosen
token and the top-k (k + 1 entries when the chosen token is not among the top k).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxserve.core.request import Logprobs, RequestOutput

# JSON has no -inf; OpenAI and vLLM clamp to this.
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class TokenText:
    """Text of single tokens (special tokens spelled out), memoized."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text


def top_k(entry: Logprobs, chosen: int, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of an entry, best first (the chosen one only if in the top k)."""
    items = entry.items()
    if len(entry) > k:  # the chosen token was added beside the top k
        items = [(t, lp) for t, lp in items if t != chosen]
    return sorted(items, key=lambda kv: -kv[1])[:k]


def chat_logprobs(
    token_ids: list[int], logprobs: list[Logprobs], k: int, text: TokenText
) -> list[dict]:
    """OpenAI chat format: one {token, logprob, bytes, top_logprobs} per generated token."""
    out = []
    for tok, entry in zip(token_ids, logprobs, strict=True):
        s = text(tok)
        out.append(
            {
                "token": s,
                "logprob": _finite(entry[tok]),
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [
                    {"token": text(t), "logprob": _finite(lp), "bytes": list(text(t).encode())}
                    for t, lp in top_k(entry, tok, k)
                ],
            }
        )
    return out


@dataclass
class CompletionLogprobs:
    """OpenAI completions format, built incrementally (text offsets continue across chunks)."""

    text: TokenText
    offset: int = 0

    def make(self, token_ids: list[int], logprobs: list[Logprobs | None]) -> dict:
        """The logprobs object of these tokens (a None entry: the first prompt token)."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for tok, entry in zip(token_ids, logprobs, strict=True):
            s = self.text(tok)
            tokens.append(s)
            offsets.append(self.offset)
            self.offset += len(s)
            if entry is None:  # the first prompt token has no logprob
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(_finite(entry[tok]))
            tops.append(
                {self.text(t): _finite(lp) for t, lp in sorted(entry.items(), key=lambda x: -x[1])}
            )
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


@dataclass
class SampleResult:
    """One sample's whole output, gathered from delta outputs."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class PromptResult:
    """Everything generated for one prompt (its n samples)."""

    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None
    num_cached_tokens: int = 0
    samples: dict[int, SampleResult] = field(default_factory=dict)

    def add(self, out: RequestOutput) -> None:
        """Fold in one delta output."""
        self.prompt = out.prompt
        self.prompt_token_ids = out.prompt_token_ids
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        for c in out.outputs:
            s = self.samples.setdefault(c.index, SampleResult())
            s.text.append(c.text)
            s.token_ids.extend(c.token_ids)
            if c.logprobs:
                s.logprobs.extend(c.logprobs)
            if c.finish_reason is not None:
                s.finish_reason, s.stop_reason = c.finish_reason, c.stop_reason

    @property
    def num_completion_tokens(self) -> int:
        """Tokens generated over all samples."""
        return sum(len(s.token_ids) for s in self.samples.values())
