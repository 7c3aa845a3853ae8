"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole reply is the call(s).

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}

A reply that does not start with ``{`` (or ``<|python_tag|>``) is content. Calls are
separated by ``;``; text after the calls that is not another call is content.
"""

from __future__ import annotations

import json

from mlxserve.parsers.base import ParsedDelta, ToolParser, arguments_json, json_end

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` replies (``arguments`` is accepted too)."""

    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._mode = "start"  # start (maybe a call) | calls (between calls) | content

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if self._mode == "content":
                out.content += self.buffer
                self.buffer = ""
                return out
            text = self.buffer.lstrip()
            if self._mode == "calls" and text.startswith(";"):
                text = text[1:].lstrip()
            if text.startswith(PYTHON_TAG):
                text = text[len(PYTHON_TAG) :].lstrip()
            if not text or (not final and PYTHON_TAG.startswith(text) and text != "{"):
                if final:  # nothing but whitespace (or separators) left
                    out.content += "" if self.num_calls else self.buffer
                    self.buffer = ""
                return out
            if not text.startswith("{"):
                self._to_content(out)
                continue
            end = json_end(text, 0)
            if end is None:
                if final:
                    self._to_content(out)
                    continue
                return out
            call = _call_of(text[:end])
            if call is None:
                self._to_content(out)
                continue
            out.tool_calls.append(self._call(*call))
            self.buffer = text[end:]
            self._mode = "calls"

    def _to_content(self, out: ParsedDelta) -> None:
        """The rest of the reply is content (after calls: without the separator)."""
        if self._mode == "calls":
            rest = self.buffer.lstrip()
            self.buffer = rest[1:].lstrip() if rest.startswith(";") else rest
        self._mode = "content"


def _call_of(text: str) -> tuple[str, str] | None:
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    if "parameters" not in call and "arguments" not in call:
        return None
    args = arguments_json(call.get("parameters", call.get("arguments")))
    return None if args is None else (call["name"], args)
