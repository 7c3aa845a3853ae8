"""Tools and tool turns of the other APIs, in the OpenAI chat terms the chat tools take.

The tool planning and the output parsers (server/chat_tools.py, parsers/) speak one
language: OpenAI chat messages (assistant ``tool_calls``, ``tool`` results), OpenAI function
tools and a tool_choice name ("none", "auto", "required" or a function's name). Each API's
shapes are translated here, in both directions, and nowhere else (the Responses API's, which
has many item and tool types of its own, in server/responses_input.py).
"""

from __future__ import annotations

import json
from typing import Any

from mlxserve.server.errors import bad_request


def function_tool(name: Any, description: Any, parameters: Any, param: str) -> dict[str, Any]:
    """An OpenAI function tool; 400 naming ``param`` when the name or schema is malformed."""
    if not isinstance(name, str) or not name:
        raise bad_request("a tool needs a name (a non-empty string)", param)
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"the schema of tool {name!r} must be a JSON object", param)
    function: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object"}}
    if isinstance(description, str):
        function["description"] = description
    return {"type": "function", "function": function}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return "" if content is None else json.dumps(content)


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    function = {"name": name, "arguments": _arguments(arguments)}
    return {"id": call_id, "type": "function", "function": function}


def call_input(arguments: str) -> Any:
    """A parsed call's arguments as an object (Anthropic's ``input``, Ollama's ``arguments``)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


# ---- Anthropic --------------------------------------------------------------------------------
def anthropic_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``tools`` (name, description, input_schema) as OpenAI function tools."""
    out = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad_request(
                f"tools[{i}]: server tools of type {kind!r} are not supported", "tools"
            )
        out.append(
            function_tool(
                tool.get("name"), tool.get("description"), tool.get("input_schema"), "tools"
            )
        )
    return out


def anthropic_tool_choice(choice: dict[str, Any] | None) -> tuple[str | None, bool]:
    """(tool_choice name, parallel calls allowed) from Anthropic's ``tool_choice``."""
    if choice is None:
        return None, True
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return choice["name"], False
    raise bad_request(
        f"tool_choice of type {kind!r} is not one of auto, any, tool, none", "tool_choice"
    )


def anthropic_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Anthropic turns (text, tool_use, tool_result, thinking blocks) as OpenAI chat messages."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role, content = message.role, message.content
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in content:
            kind = block.get("type")
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append(
                    _call(str(block.get("id")), str(block.get("name")), block.get("input", {}))
                )
            elif kind == "tool_result" and role == "user":
                result = _text(block.get("content"))
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": str(block.get("tool_use_id")),
                        "content": result,
                    }
                )
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier reasoning is not part of the next prompt
            else:
                raise bad_request(
                    f"messages[{i}]: content blocks of type {kind!r} are not supported here",
                    "messages",
                )
        if calls:
            out.append(
                {"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls}
            )
        elif texts or role == "assistant":
            out.append({"role": role, "content": "".join(texts)})
    return out


# ---- Ollama -----------------------------------------------------------------------------------
def ollama_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama messages (tool_calls with object arguments, tool results) as chat messages."""
    out = []
    for message in messages:
        role = message["role"]
        calls = message.get("tool_calls") or []
        if role == "assistant" and calls:
            converted = [
                _call(
                    f"call_{len(out)}_{j}",
                    str(c.get("function", {}).get("name")),
                    c.get("function", {}).get("arguments", {}),
                )
                for j, c in enumerate(calls)
            ]
            out.append(
                {"role": role, "content": message.get("content") or None, "tool_calls": converted}
            )
        elif role == "tool":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(message.get("tool_name") or ""),
                    "content": message.get("content", ""),
                }
            )
        else:
            out.append({"role": role, "content": message.get("content", "")})
    return out
