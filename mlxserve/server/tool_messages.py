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
from mlxserve.server.json_schemas import check_tool_schema


def function_tool(
    name: Any, description: Any, parameters: Any, param: str, schema_param: str
) -> dict[str, Any]:
    """An OpenAI function tool; 400 naming ``param`` when the name is malformed, and
    ``schema_param`` (the API's own path, e.g. ``tools.2.input_schema``) for the schema."""
    if not isinstance(name, str) or not name:
        raise bad_request("a tool needs a name (a non-empty string)", param)
    if parameters is not None:
        check_tool_schema(parameters, schema_param)
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
def anthropic_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], list[str]]:
    """(OpenAI function tools, names of the server tools left out) from Anthropic's ``tools``.

    Custom tools (no ``type``, or ``"custom"``) become function tools; server tools
    (``web_search_*``, ``bash_*``, ``mcp_toolset``...) run on Anthropic's side, so they are
    left out here; hints on a tool (cache_control, strict, defer_loading...) change nothing.
    """
    out: list[dict[str, Any]] = []
    dropped: list[str] = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict):
            raise bad_request(f"tools.{i}: Input should be an object", f"tools.{i}")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            dropped.append(str(tool.get("name") or tool.get("mcp_server_name") or kind))
            continue
        schema = tool.get("input_schema")
        name, description = tool.get("name"), tool.get("description")
        out.append(function_tool(name, description, schema, "tools", f"tools.{i}.input_schema"))
    return out, dropped


def anthropic_tool_choice(
    choice: dict[str, Any] | None, tools: list[dict[str, Any]], dropped: list[str]
) -> tuple[str | None, bool]:
    """(tool_choice name, parallel calls allowed) from Anthropic's ``tool_choice``."""
    if choice is None:
        return None, True
    if not isinstance(choice, dict):
        raise bad_request("tool_choice: Input should be an object", "tool_choice")
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request(
            f"tool_choice: Input tag {kind!r} found using 'type' does not match any of the "
            "expected tags: 'auto', 'any', 'tool', 'none'",
            "tool_choice",
        )
    if kind == "none":
        return "none", parallel
    name = choice.get("name")
    if kind == "tool" and name in dropped:
        raise bad_request(
            f"tool_choice.name: {name!r} is a server tool, which this server does not run; "
            "only custom tools can be forced",
            "tool_choice.name",
        )
    if kind in ("any", "tool") and not tools:
        raise bad_request(
            f"tool_choice.type {kind!r} may only be specified while providing tools", "tool_choice"
        )
    if kind == "auto":
        return ("auto" if tools else None), parallel
    if kind == "any":
        return "required", parallel
    if not isinstance(name, str):
        raise bad_request("tool_choice.name: Field required", "tool_choice.name")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice.name: tool {name!r} not found in tools", "tool_choice.name")
    return name, False


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
