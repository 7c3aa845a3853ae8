"""Mistral tool calls after the ``[TOOL_CALLS]`` control token, in either of its formats.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]    (v3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                           (v11+)

``[TOOL_CALLS]`` is a special token: the output is decoded with special tokens kept.
Mistral's chat templates accept only 9-character tool call ids, so ids are made so.
"""

from __future__ import annotations

import json

from mlxserve.parsers.base import (
    MarkedCallParser,
    arguments_json,
    json_end,
    make_short_tool_call_id,
)

ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


class MistralToolParser(MarkedCallParser):
    """``[TOOL_CALLS]`` then a JSON list of calls, or ``name[ARGS]{...}`` (one call)."""

    name = "mistral"
    needs_special_tokens = True
    start_marker = "[TOOL_CALLS]"
    markers = (start_marker, ARGS)

    def new_id(self) -> str:
        return make_short_tool_call_id()

    def call_end(self, text: str) -> tuple[int, int] | None:
        body = text.lstrip()
        skipped = len(text) - len(body)
        if body.startswith("["):
            end = json_end(body, 0)
        else:
            at = body.find(ARGS)
            if at < 0:
                return None
            args = body[at + len(ARGS) :]
            start = at + len(ARGS) + len(args) - len(args.lstrip())
            end = json_end(body, start) if body[start : start + 1] == "{" else None
        return None if end is None else (skipped + end, skipped + end)

    def parse_calls(self, body: str) -> list[tuple] | None:
        body = body.strip()
        if body.startswith("["):
            return _list_calls(body)
        head, sep, args = body.partition(ARGS)
        name, _, call_id = head.partition(CALL_ID)
        arguments = arguments_json(_loads(args)) if sep else None
        if arguments is None or not name.strip():
            return None
        return [(name.strip(), arguments, call_id.strip() or None)]


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _list_calls(text: str) -> list[tuple] | None:
    calls = _loads(text)
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = arguments_json(call.get("arguments", call.get("parameters", {})))
        if args is None:
            return None
        call_id = call.get("id") if isinstance(call.get("id"), str) else None
        out.append((call["name"], args, call_id))
    return out
