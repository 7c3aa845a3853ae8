"""Hermes / Qwen2.5 / Qwen3 tool calls: JSON between ``<tool_call>`` tags.

Let me check.
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
"""

from __future__ import annotations

import json

from mlxserve.parsers.base import MarkedCallParser, arguments_json


class HermesToolParser(MarkedCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one call per block."""

    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"
    markers = (start_marker, end_marker)

    def parse_calls(self, body: str) -> list[tuple[str, str]] | None:
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = arguments_json(call.get("arguments", call.get("parameters", {})))
        return None if args is None else [(call["name"], args)]
