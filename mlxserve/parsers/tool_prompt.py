"""Tools in the prompt: what the chat template gets, natively or through a fallback.

A template that knows tools (it reads the ``tools`` variable) renders them, the
assistant's ``tool_calls`` and the ``tool`` messages its own way; the arguments of past
calls are handed to it as objects, as transformers' templates expect. A template that
does not (e.g. SmolLM2's) gets, when the request has tools or its messages hold calls, the
tools described in the system message, past calls written into the assistant's text in the
Hermes format (``<tool_call>...``), and tool results as user messages in
``<tool_response>`` tags; the hermes parser reads the reply.
"""

from __future__ import annotations

import json
from typing import Any

FALLBACK_PARSER = "hermes"

TOOLS_INSTRUCTIONS = """You can call functions. Their signatures, as JSON:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and arguments between <tool_call> \
and </tool_call> tags, one call per pair of tags:
<tool_call>
{{"name": "function_name", "arguments": {{"argument": "value"}}}}
</tool_call>
The results come back between <tool_response> and </tool_response> tags."""


def native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that renders tools itself: call arguments as objects."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = dict(message)
            message["tool_calls"] = [_with_object_arguments(c) for c in calls]
        out.append(message)
    return out


def fallback_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Messages for a template that knows no tools: tools, calls and results as text."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            text = _text(message.get("content"))
            calls = [_hermes_call(c) for c in message["tool_calls"]]
            turn = {"role": "assistant", "content": "\n".join(filter(None, [text, *calls]))}
            if message.get("reasoning_content"):  # templates that show earlier reasoning
                turn["reasoning_content"] = message["reasoning_content"]
            out.append(turn)
        elif role == "tool":
            result = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + result  # consecutive results: one user turn
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        else:
            out.append(message)
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        instructions = TOOLS_INSTRUCTIONS.format(tools=listing)
        if out and out[0].get("role") == "system":
            system = _text(out[0].get("content"))
            text = f"{system}\n\n{instructions}" if system else instructions
            out[0] = {**out[0], "content": text}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def _text(content: Any) -> str:
    """A message's content as text (a list of text parts joined by newlines)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _with_object_arguments(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    function["arguments"] = _arguments_object(function.get("arguments"))
    return {**call, "function": function}


def _hermes_call(call: Any) -> str:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    body = {"name": function.get("name"), "arguments": _arguments_object(function.get("arguments"))}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"
