"""A request's reasoning effort as the chat template's reasoning switch.

OpenAI's ``reasoning.effort`` / ``reasoning_effort`` (none, minimal, low, medium, high, xhigh,
max) becomes the variables templates read for it: ``enable_thinking`` (Qwen3, SmolLM3),
``thinking`` (DeepSeek-V3.1, Granite) and ``reasoning_effort`` (gpt-oss: low, medium, high).
"none" and "minimal" turn thinking off where the template can; a template without a switch
reads none of them and renders as before.
"""

from __future__ import annotations

from typing import Any

from mlxserve.server.errors import bad_request

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_GPT_OSS_EFFORT = {"none": "low", "minimal": "low", "xhigh": "high", "max": "high"}


def effort_template_kwargs(effort: str | None, param: str) -> dict[str, Any]:
    """Template variables for ``effort`` (none when not given); 400 naming ``param``."""
    if effort is None:
        return {}
    if effort not in REASONING_EFFORTS:
        raise bad_request(f"{param} {effort!r} is not one of {', '.join(REASONING_EFFORTS)}", param)
    thinking = effort not in ("none", "minimal")
    return {
        "enable_thinking": thinking,
        "thinking": thinking,
        "reasoning_effort": _GPT_OSS_EFFORT.get(effort, effort),
    }
