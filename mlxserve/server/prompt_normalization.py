"""Agents' volatile prompt parts, neutralized so a conversation renders to the same tokens
every turn and the prefix cache holds it (`mlxserve serve --prompt-normalization`).

A coding agent resends its whole conversation each turn. Two parts of it change every time
without changing what the model should do, and each one placed early defeats the prefix
cache for everything after it:

- ``billing-header``: Claude Code's first system block, ``x-anthropic-billing-header:
  cc_version=...; cc_entrypoint=...; cch=<5 hex>;``, whose ``cch`` is a hash of the request
  (the prompt diverges at token ~40). It is accounting for Anthropic's API, not text for a
  model: the line is removed from system messages.
- ``token-markers``: ``<total_tokens>N tokens left</total_tokens>`` budget reminders, in the
  system prompt and after tool results, whose N falls every turn. They are removed from every
  message but the last (the part of the prompt no cache holds yet); the system prompt's
  latest one moves to the end of the last message, so the model still reads the budget.

Mid-conversation system messages stay where the client put them. The parts are applied to
the chat messages every API translates into, before the template renders them.

A template can also render an earlier turn differently from how the model produced it:
Qwen3's leaves out the reasoning of assistant turns before the last user message, so the
tokens the engine generated (and cached) for a reply stop matching at that reply's start
on the next turn. That is the template's choice, not the client's; ``dropped_reasoning``
detects it, and the server says so once in its log.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

PARTS = ("billing-header", "token-markers")
DEFAULT = PARTS

_BILLING_HEADER = re.compile(r"^x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE)
_TOKEN_MARKER = re.compile(r"\n?<total_tokens>[^<\n]*</total_tokens>")
_SYSTEM_ROLES = ("system", "developer")


def parse_parts(spec: str) -> tuple[str, ...]:
    """``--prompt-normalization``'s value: a comma-separated list of PARTS, "all" or "none"."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if names in (["none"], []):
        return ()
    if names == ["all"]:
        return PARTS
    unknown = [name for name in names if name not in PARTS]
    if unknown:
        raise ValueError(
            f"unknown prompt normalization {', '.join(map(repr, unknown))}: "
            f"choose from {', '.join(PARTS)}, or all, or none"
        )
    return tuple(dict.fromkeys(names))


def normalize(messages: list[dict[str, Any]], parts: tuple[str, ...]) -> list[dict[str, Any]]:
    """``messages`` with ``parts`` neutralized (new dicts where something changed; the
    caller's are never modified)."""
    if not parts or not messages:
        return messages
    out = list(messages)
    if "billing-header" in parts:
        for i, m in enumerate(out):
            if m.get("role") in _SYSTEM_ROLES:
                out[i] = _edit_text(m, lambda text: _BILLING_HEADER.sub("", text))
    if "token-markers" in parts:
        moved: list[str] = []
        for i, m in enumerate(out[:-1]):
            if m.get("role") in _SYSTEM_ROLES:
                moved += [found.strip() for t in _texts(m) for found in _TOKEN_MARKER.findall(t)]
            out[i] = _edit_text(m, lambda text: _TOKEN_MARKER.sub("", text))
        if moved and not any(_TOKEN_MARKER.search(t) for t in _texts(out[-1])):
            out[-1] = _append_text(out[-1], "\n" + moved[-1])
    return out


def dropped_reasoning(messages: list[dict[str, Any]], rendered: str) -> int:
    """How many earlier assistant turns' reasoning the rendered prompt leaves out."""
    return sum(
        1
        for m in messages[:-1]
        if m.get("role") == "assistant"
        and isinstance(m.get("reasoning_content"), str)
        and m["reasoning_content"].strip()
        and m["reasoning_content"].strip() not in rendered
    )


def _texts(message: dict[str, Any]) -> list[str]:
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
    return []


def _edit_text(message: dict[str, Any], edit: Callable[[str], str]) -> dict[str, Any]:
    """``message`` with ``edit`` applied to its text (a string, or each text part)."""
    content = message.get("content")
    if isinstance(content, str):
        new = edit(content)
        return message if new == content else message | {"content": new}
    if not isinstance(content, list):
        return message
    parts = [
        p | {"text": edit(p["text"])}
        if isinstance(p, dict) and isinstance(p.get("text"), str)
        else p
        for p in content
    ]
    return message if parts == content else message | {"content": parts}


def _append_text(message: dict[str, Any], text: str) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        return message | {"content": [*content, {"type": "text", "text": text.lstrip("\n")}]}
    return message | {"content": (content or "") + text}
