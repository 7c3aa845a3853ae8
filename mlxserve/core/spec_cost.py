"""Cost-aware back-off for speculative decoding: speculate only while it pays.

Acceptance alone does not say whether speculation pays: on a CPU a verification step over
a long context can cost more than the decode steps its accepted drafts save, even when
most drafts are accepted. So the engine measures what it is after, **seconds per emitted
token**, for steps that verified drafts and for steps that did not, and keeps the cheaper.

Per bucket of batch size (1, 2-3, 4-7, 8-15, ...) and context length (the longest in the
step: < 512, 512-1023, 1024-2047, ... tokens), since a step's cost depends on both (a
verified draft attends to the whole context), two exponential moving averages are kept,
of a step's wall time and of the tokens it emitted; their ratio is the mode's cost per
token::

    spec  = EMA(step seconds) / EMA(tokens emitted)   steps that verified drafts
    plain = the same                                   decode steps without drafts

Only steps where every request decodes are measured (a prefill chunk's cost is not a
token's). Once both modes have ``MIN_STEPS`` observations, speculation turns off when
``spec >= plain`` and back on when ``spec < ON_MARGIN * plain`` (a 10% margin, so noise
does not flip it back and forth). The mode not in use goes stale, so after
``probe_interval`` steps in one mode the other runs for ``PROBE_STEPS`` steps (a probe;
the first one after ``FIRST_PROBE`` steps, while the other mode has no measurements);
each probe that confirms the current mode doubles the interval (up to
``MAX_PROBE_INTERVAL``), a switch resets it. While speculating, steps where no request
had drafts (nothing matched) count as plain ones, so a plain probe is rarely needed.

The logic is pure (no clock): the caller passes each step's seconds, so tests drive it
with made-up costs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger("mlxserve")

ALPHA = 0.25  # weight of a new step in the moving averages
MIN_STEPS = 3  # observations of each mode before it can decide
PROBE_STEPS = 4  # steps of the other mode per probe
PROBE_INTERVAL = 32  # steps in one mode before a probe of the other
# Steps before the first probe of a mode never measured in this bucket: exploring is
# paid by the first request at a batch size and context length, so it is kept short.
FIRST_PROBE = 8
MAX_PROBE_INTERVAL = 512
# Drafts are turned back on only when they are this much cheaper per token: where both
# modes cost about the same, step-time noise would otherwise flip the choice back and
# forth, and plain decoding is the safe side.
ON_MARGIN = 0.9


CONTEXT_UNIT = 512  # tokens: context buckets are < 512, 512-1023, 1024-2047, ...


def batch_bucket(batch_size: int) -> int:
    """The bucket of a step with ``batch_size`` requests: 1, 2-3, 4-7, ... -> 1, 2, 3, ..."""
    return max(batch_size, 1).bit_length()


def context_bucket(context_len: int) -> int:
    """The bucket of a step whose longest context is ``context_len`` tokens:
    < 512, 512-1023, 1024-2047, ... -> 0, 1, 2, ..."""
    return (max(context_len, 0) // CONTEXT_UNIT).bit_length()


@dataclass(slots=True)
class StepRate:
    """Moving averages of one mode's step time and emitted tokens."""

    seconds: float = 0.0
    tokens: float = 0.0
    num_steps: int = 0

    def add(self, seconds: float, tokens: int) -> None:
        """Fold one step in (the first one sets the averages)."""
        a = 1.0 if self.num_steps == 0 else ALPHA
        self.seconds += a * (seconds - self.seconds)
        self.tokens += a * (tokens - self.tokens)
        self.num_steps += 1

    @property
    def per_token(self) -> float:
        """Seconds per emitted token (inf before any token)."""
        return self.seconds / self.tokens if self.tokens > 0 else float("inf")


@dataclass(slots=True)
class BucketState:
    """One batch-size bucket: both modes' rates and which one runs."""

    plain: StepRate = field(default_factory=StepRate)
    spec: StepRate = field(default_factory=StepRate)
    is_on: bool = True  # speculation is the mode in use
    steps_in_mode: int = 0  # steps since the last switch or probe
    probe_left: int = 0  # steps left of a probe of the other mode
    probe_interval: int = PROBE_INTERVAL

    def rate(self, speculated: bool) -> StepRate:
        return self.spec if speculated else self.plain


class CostBackoff:
    """Decides per step whether to speculate, from the measured cost per emitted token."""

    def __init__(self) -> None:
        self.buckets: dict[tuple[int, int], BucketState] = {}
        self.num_switches = 0

    def state(self, batch_size: int, context_len: int = 0) -> BucketState:
        """The state of the bucket of a step with ``batch_size`` requests, the longest
        ``context_len`` tokens (made on first use)."""
        key = (batch_bucket(batch_size), context_bucket(context_len))
        return self.buckets.setdefault(key, BucketState())

    def should_speculate(self, batch_size: int, context_len: int = 0) -> bool:
        """Whether a step of ``batch_size`` decoding requests proposes drafts."""
        s = self.state(batch_size, context_len)
        return s.is_on != (s.probe_left > 0)  # a probe runs the other mode

    def observe(
        self,
        batch_size: int,
        speculated: bool,
        seconds: float,
        num_tokens: int,
        context_len: int = 0,
    ) -> None:
        """Account one decode-only step: its wall time and the tokens it emitted;
        ``speculated``: some request in it verified drafts."""
        if num_tokens <= 0:
            return
        s = self.state(batch_size, context_len)
        s.rate(speculated).add(seconds, num_tokens)
        if s.probe_left > 0:
            s.probe_left -= 1
            if s.probe_left == 0:
                self._decide(s, batch_size, context_len, after_probe=True)
            return
        s.steps_in_mode += 1
        self._decide(s, batch_size, context_len, after_probe=False)
        unknown = s.rate(not s.is_on).num_steps < MIN_STEPS
        if s.steps_in_mode >= (FIRST_PROBE if unknown else s.probe_interval):
            s.probe_left, s.steps_in_mode = PROBE_STEPS, 0

    def _decide(self, s: BucketState, batch_size: int, context_len: int, after_probe: bool) -> None:
        if s.plain.num_steps < MIN_STEPS or s.spec.num_steps < MIN_STEPS:
            return
        limit = s.plain.per_token * (1.0 if s.is_on else ON_MARGIN)
        want_on = s.spec.per_token < limit
        if want_on == s.is_on:
            if after_probe:  # the probe confirmed the mode: probe less often
                s.probe_interval = min(2 * s.probe_interval, MAX_PROBE_INTERVAL)
            return
        s.is_on, s.steps_in_mode, s.probe_left = want_on, 0, 0
        s.probe_interval = PROBE_INTERVAL
        self.num_switches += 1
        logger.info(
            "speculative decoding %s at batch %d, context %d: %.1f ms per token with drafts, "
            "%.1f ms without",
            "on" if want_on else "off",
            batch_size,
            context_len,
            1000 * s.spec.per_token,
            1000 * s.plain.per_token,
        )

    def is_on(self, batch_size: int, context_len: int = 0) -> bool:
        """The mode in use for this bucket (probes aside)."""
        return self.state(batch_size, context_len).is_on
