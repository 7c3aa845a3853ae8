"""Ollama's ``keep_alive``: how long a model stays loaded after its last request.

A value is a number of seconds or a Go duration ("5m", "1h30m", "10s", "0"); a negative
one ("-1", "-1m") keeps the model loaded for good, 0 unloads it once its requests are over.
"""

from __future__ import annotations

import re

# One Go duration term: a number and its unit ("1.5h", "30s", "500ms").
_TERM = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
FOREVER = None  # a keep_alive that never unloads


def parse_keep_alive(value: str | int | float, field: str = "keep_alive") -> float | None:
    """Seconds to stay loaded after the last request (0: unload now), or None for ever
    (a negative value); ValueError naming ``field`` for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a duration like '5m' or a number of seconds")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        seconds = _parse_duration(value.strip(), field)
    if seconds != seconds or seconds == float("inf"):  # NaN, inf
        raise ValueError(f"{field} must be a finite duration, got {value!r}")
    return FOREVER if seconds < 0 else seconds


def _parse_duration(text: str, field: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    try:
        return sign * float(body)  # "300", "-1": seconds, as Ollama takes a bare number
    except ValueError:
        pass
    pos, total = 0, 0.0
    for m in _TERM.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if not body or pos != len(body):
        raise ValueError(
            f"{field}: {text!r} is not a duration (examples: '5m', '1h30m', '10s', '0', '-1')"
        )
    return sign * total


def describe_keep_alive(seconds: float | None) -> str:
    """A keep_alive for the log: "5m", "90s", "forever"."""
    if seconds is None:
        return "forever"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"
