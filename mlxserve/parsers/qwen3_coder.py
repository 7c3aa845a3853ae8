"""Qwen3-Coder tool calls: XML-ish function and parameter tags, values as plain text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are typed by the tool's JSON schema (``days`` is an integer there, so 3, not "3").
A block holding Hermes-style JSON instead is read too (it is what a forced call writes).
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlxserve.parsers.base import MarkedCallParser
from mlxserve.parsers.hermes import HermesToolParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderToolParser(MarkedCallParser):
    """``<tool_call><function=name><parameter=p>value</parameter></function></tool_call>``."""

    name = "qwen3_coder"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"
    markers = (start_marker, end_marker)

    def parse_calls(self, body: str) -> list[tuple[str, str]] | None:
        if body.lstrip().startswith("{"):  # Hermes-style JSON (what a forced call writes)
            return HermesToolParser.parse_calls(self, body)
        calls = []
        for function in _FUNCTION.finditer(body):
            name = function.group(1).strip()
            schema = self.functions.get(name, {}).get("parameters") or {}
            props = schema.get("properties") or {}
            args = {}
            for param in _PARAMETER.finditer(function.group(2)):
                key = param.group(1).strip()
                args[key] = _typed(_unwrap(param.group(2)), props.get(key) or {})
            calls.append((name, json.dumps(args, ensure_ascii=False)))
        # Text outside the function tags means the block is not a well-formed call.
        if not calls or _FUNCTION.sub("", body).strip():
            return None
        return calls


def _unwrap(value: str) -> str:
    """The value without the newline the format puts after and before the tags."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _typed(value: str, schema: dict) -> Any:
    """The value as the parameter's schema types it; text when it does not parse so."""
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    if "string" in types or types == [None]:
        return value
    text = value.strip()
    if "null" in types and text == "null":
        return None
    if "boolean" in types and text in ("true", "false"):
        return text == "true"
    try:
        parsed = json.loads(text)
    except ValueError:
        return value
    if isinstance(parsed, bool) or parsed is None:
        return value
    if ("integer" in types and isinstance(parsed, int)) or (
        "number" in types and isinstance(parsed, (int, float))
    ):
        return parsed
    if ("object" in types and isinstance(parsed, dict)) or (
        "array" in types and isinstance(parsed, list)
    ):
        return parsed
    return value
