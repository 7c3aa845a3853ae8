"""The Responses API's tools, tool_choice and input items in the chat terms ChatRun takes.

Tools become OpenAI chat function tools, each under the flat name the model sees; a
``ResponsesTools`` remembers what each flat name was, so a call the model writes goes back
out as the item the client expects (``function_call`` with its ``namespace``,
``custom_tool_call``, ``local_shell_call``)::

    {"type": "function", "name": "f"}                         -> f
    {"type": "namespace", "name": "mcp__git__", "tools": [f]} -> mcp__git__f (Codex's own
                                                                  display name)
    {"type": "namespace", "name": "git", "tools": [f]}        -> git__f
    {"type": "custom", "name": "apply_patch", "format": ...}  -> apply_patch({"input": str})
    {"type": "local_shell"}                                   -> local_shell({"command": [...]})

Tools that run on OpenAI's side (web search, file search, computer use, code interpreter,
image generation, MCP servers, ...) have nothing to run them here: they are dropped, with
one warning per request, and a tool_choice that names one is refused.

Input items become chat messages in order: ``system`` and ``developer`` messages stay where
they are (mid-conversation ones too), reasoning items ride on the assistant turn that
follows them (as ``reasoning_content``, which templates that keep reasoning render).
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxserve.server.errors import APIError, bad_request
from mlxserve.server.tool_messages import function_tool

logger = logging.getLogger("mlxserve.server")

# Tools OpenAI runs on its side: nothing runs them here, so they are dropped.
SERVER_TOOLS = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "computer",
        "computer_use",
        "computer_use_preview",
        "code_interpreter",
        "image_generation",
        "mcp",
        "tool_search",
        "programmatic_tool_calling",
        "shell",
        "apply_patch",
    }
)
# Output items of those tools, sent back in later turns' input: nothing to render.
SERVER_TOOL_ITEMS = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "code_interpreter_call",
        "image_generation_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "tool_search_call",
        "tool_search_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "additional_tools",
        "configuration_update",
        "compaction",
        "compaction_trigger",
        "program",
        "program_output",
    }
)

LOCAL_SHELL = "local_shell"
_LOCAL_SHELL_SCHEMA = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}},
        "working_directory": {"type": "string"},
        "timeout_ms": {"type": "integer"},
        "env": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "required": ["command"],
}
_LOCAL_SHELL_DOC = "Run a command (argv list) in a shell on the user's machine."

# encrypted_content of the reasoning items mlxserve returns: the reasoning text, readable
# (a local server has no secret to keep from its own client), marked so it is recognized.
REASONING_MARKER = "mlxserve-reasoning-v1:"


def encode_reasoning(text: str) -> str:
    """The ``encrypted_content`` that carries ``text`` to the next request."""
    payload = json.dumps({"text": text}, ensure_ascii=False).encode("utf-8")
    return REASONING_MARKER + base64.b64encode(payload).decode("ascii")


def decode_reasoning(content: Any) -> str | None:
    """The text of an ``encrypted_content`` mlxserve wrote; None for anyone else's."""
    if not isinstance(content, str) or not content.startswith(REASONING_MARKER):
        return None
    try:
        data = json.loads(base64.b64decode(content[len(REASONING_MARKER) :], validate=True))
    except ValueError:
        return None
    text = data.get("text") if isinstance(data, dict) else None
    return text if isinstance(text, str) else None


@dataclass(frozen=True)
class ToolTarget:
    """What the model's call of one flat tool name is, in the Responses API's terms."""

    kind: str  # "function" | "custom" | "local_shell"
    name: str
    namespace: str | None = None


@dataclass
class ResponsesTools:
    """A request's tools: chat function tools, their targets, and what was dropped."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    targets: dict[str, ToolTarget] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)  # types of server tools left out

    def add(self, tool: dict[str, Any], target: ToolTarget, param: str) -> None:
        name = tool["function"]["name"]
        if name in self.targets:
            raise bad_request(f"{param}: two tools are named {name!r}", param)
        self.tools.append(tool)
        self.targets[name] = target

    def target(self, name: str) -> ToolTarget:
        """The target of a called name (a plain function if the model made one up)."""
        return self.targets.get(name) or ToolTarget("function", name)


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for ``name`` in ``namespace``."""
    if not namespace:
        return name
    sep = "" if namespace[-1] in "_.-/" else "__"
    return namespace + sep + name


def responses_tools(tools: list[dict[str, Any]] | None) -> ResponsesTools:
    """The request's ``tools`` as chat function tools (400 naming ``tools.N`` if malformed)."""
    out = ResponsesTools()
    for i, tool in enumerate(tools or ()):
        param = f"tools.{i}"
        if not isinstance(tool, dict):
            raise bad_request(f"{param} must be an object", param)
        kind = tool.get("type")
        if kind == "function":
            _add_function(out, tool, None, param)
        elif kind == "custom":
            _add_custom(out, tool, None, param)
        elif kind == "namespace":
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not namespace:
                raise bad_request(f"{param}: a namespace needs a name", f"{param}.name")
            members = tool.get("tools")
            if not isinstance(members, list):
                raise bad_request(f"{param}.tools must be a list of tools", f"{param}.tools")
            for j, member in enumerate(members):
                where = f"{param}.tools.{j}"
                kind = member.get("type") if isinstance(member, dict) else None
                if kind == "function":
                    _add_function(out, member, namespace, where)
                elif kind == "custom":
                    _add_custom(out, member, namespace, where)
                else:
                    raise bad_request(
                        f"{where}: a namespace holds function and custom tools, not {kind!r}",
                        f"{where}.type",
                    )
        elif kind == LOCAL_SHELL:
            tool = function_tool(LOCAL_SHELL, _LOCAL_SHELL_DOC, _LOCAL_SHELL_SCHEMA, param, param)
            out.add(tool, ToolTarget(LOCAL_SHELL, LOCAL_SHELL), param)
        elif kind in SERVER_TOOLS:
            out.dropped.append(kind)
        else:
            raise bad_request(f"{param}: unknown tool type {kind!r}", f"{param}.type")
    if out.dropped:
        logger.warning(
            "responses: tools run by OpenAI's servers are left out (mlxserve has none): %s",
            ", ".join(sorted(set(out.dropped))),
        )
    return out


def _add_function(
    out: ResponsesTools, tool: dict[str, Any], namespace: str | None, param: str
) -> None:
    name = tool.get("name")
    chat = function_tool(
        flat_name(namespace, name) if isinstance(name, str) else name,
        tool.get("description"),
        tool.get("parameters"),
        f"{param}.name",
        f"{param}.parameters",
    )
    out.add(chat, ToolTarget("function", name, namespace), param)  # type: ignore[arg-type]


def _add_custom(
    out: ResponsesTools, tool: dict[str, Any], namespace: str | None, param: str
) -> None:
    """A freeform tool as a function of one string, ``input``; a regex format constrains it
    (enforced when the call is forced), a Lark grammar is shown to the model."""
    name = tool.get("name")
    description = tool.get("description") if isinstance(tool.get("description"), str) else ""
    schema: dict[str, Any] = {"type": "string"}
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        syntax, definition = fmt.get("syntax"), fmt.get("definition")
        if not isinstance(definition, str) or syntax not in ("lark", "regex"):
            raise bad_request(
                f"{param}.format: a grammar format has syntax 'lark' or 'regex' and a "
                "definition string",
                f"{param}.format",
            )
        if syntax == "regex":
            schema["pattern"] = definition
        else:
            description += f"\n\nThe input follows this Lark grammar:\n{definition}"
    elif fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request(f"{param}.format must be text or grammar", f"{param}.format")
    parameters = {
        "type": "object",
        "properties": {"input": schema},
        "required": ["input"],
        "additionalProperties": False,
    }
    chat = function_tool(
        flat_name(namespace, name) if isinstance(name, str) else name,
        (description + "\n\nCall it with the whole input as one string.").strip(),
        parameters,
        f"{param}.name",
        f"{param}.format",
    )
    out.add(chat, ToolTarget("custom", name, namespace), param)  # type: ignore[arg-type]


def custom_input(arguments: str) -> str:
    """A custom tool's ``input`` from the call's arguments (the raw text if not an object)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments


def responses_tool_choice(choice: str | dict[str, Any] | None, tools: ResponsesTools) -> str | None:
    """The chat tool_choice name for ``tool_choice`` (``allowed_tools`` narrows ``tools``)."""
    if choice == "auto" and not tools.tools:
        return None  # Codex sends "auto" always, also when every tool was a server tool
    if choice is None or choice in ("none", "auto", "required"):
        return choice  # type: ignore[return-value]
    if not isinstance(choice, dict):
        raise bad_request(
            f"tool_choice {choice!r} is not one of none, auto, required or a tool object",
            "tool_choice",
        )
    kind = choice.get("type")
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        name = choice["name"]
        if name in tools.targets:
            return name
        inner = [flat for flat, t in tools.targets.items() if t.name == name and t.kind == kind]
        return inner[0] if len(inner) == 1 else name  # the planner names what is missing
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        allowed = choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise bad_request(
                "tool_choice of type allowed_tools needs mode auto or required and a list of tools",
                "tool_choice",
            )
        names = set()
        for entry in allowed:
            entry_type = entry.get("type") if isinstance(entry, dict) else None
            if entry_type in SERVER_TOOLS:
                continue  # dropped with the rest of the server tools
            if entry_type == LOCAL_SHELL:
                names.add(LOCAL_SHELL)
            elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
                names.add(flat_name(entry.get("namespace"), entry["name"]))
        tools.tools = [t for t in tools.tools if t["function"]["name"] in names]
        return mode if tools.tools else "none"
    if kind in SERVER_TOOLS or kind in ("mcp", "computer_use_preview"):
        raise bad_request(
            f"Tool choice '{kind}' names a tool that runs on OpenAI's servers; mlxserve "
            "runs no such tool (it leaves those tools out of the request)",
            "tool_choice",
        )
    raise bad_request(f"tool_choice of type {kind!r} is not supported", "tool_choice")


def _text(content: Any, where: str) -> str:
    """The text of a message's content (a string or text parts); 400 for other parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(
                f"{where}.{j}: content of type {kind!r} needs a model that reads it; this "
                "server's model reads text only",
                f"{where}.{j}.type",
            )
        else:
            raise bad_request(f"{where}.{j}: content of type {kind!r} is not supported", where)
    return "".join(texts)


def _output_text(output: Any, where: str) -> str:
    """A tool output: a string, or content parts (their text)."""
    if output is None:
        return ""
    if isinstance(output, (str, list)):
        return _text(output, where)
    return json.dumps(output, ensure_ascii=False)


def _call(call_id: Any, name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": str(call_id), "type": "function", "function": {"name": name, "arguments": args}}


def reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its encrypted_content if mlxserve wrote it, else its content
    (reasoning_text parts), else its summary."""
    text = decode_reasoning(item.get("encrypted_content"))
    if text is not None:
        return text
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            return "\n\n".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
    return ""


def responses_items(
    items: list[dict[str, Any]],
    lookup: Callable[[str], dict[str, Any] | None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Responses input items as chat messages, in place; ``lookup`` resolves item_reference."""
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items waiting for their assistant turn
    skipped: list[str] = []

    def assistant(message: dict[str, Any], joins_calls: bool = False) -> None:
        last = out[-1] if out else None
        if joins_calls and last is not None and last["role"] == "assistant":
            if last.get("tool_calls") or last.get("content"):  # parallel calls: one turn
                last.setdefault("tool_calls", []).extend(message["tool_calls"])
                if reasoning:
                    before = last.get("reasoning_content")
                    last["reasoning_content"] = "\n\n".join(filter(None, [before, *reasoning]))
                    reasoning.clear()
                return
        if reasoning:
            message["reasoning_content"] = "\n\n".join(reasoning)
            reasoning.clear()
        out.append(message)

    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "item_reference":
            ref = item.get("id")
            found = lookup(ref) if isinstance(ref, str) else None
            if found is None:
                raise APIError(404, f"Item with id {ref!r} not found.", f"{where}.id")
            item, kind = found, found.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(
                    f"{where}: role {role!r} is not one of user, assistant, system, developer",
                    f"{where}.role",
                )
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                assistant({"role": "assistant", "content": text})
            else:  # system and developer stay in place: never hoisted to the front
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind in ("function_call", "custom_tool_call", "local_shell_call"):
            if kind == "function_call":
                name = flat_name(item.get("namespace"), str(item.get("name")))
                call = _call(item.get("call_id"), name, item.get("arguments", "{}"))
            elif kind == "custom_tool_call":
                name = flat_name(item.get("namespace"), str(item.get("name")))
                call = _call(item.get("call_id"), name, {"input": str(item.get("input", ""))})
            else:
                action = item.get("action") if isinstance(item.get("action"), dict) else {}
                args = {k: v for k, v in action.items() if k != "type" and v is not None}
                call = _call(item.get("call_id") or item.get("id"), LOCAL_SHELL, args)
            assistant({"role": "assistant", "content": None, "tool_calls": [call]}, True)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = _output_text(item.get("output"), f"{where}.output")
            out.append(
                {"role": "tool", "tool_call_id": str(item.get("call_id")), "content": output}
            )
        elif kind == "local_shell_call_output":
            output = _output_text(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": str(item.get("id")), "content": output})
        elif kind == "reasoning":
            text = reasoning_text(item)
            if text:
                reasoning.append(text)
        elif kind in SERVER_TOOL_ITEMS:
            skipped.append(kind)
        else:
            raise bad_request(f"{where}: items of type {kind!r} are not supported", f"{where}.type")
    if skipped:
        logger.warning(
            "responses: input items of server-side tools are left out: %s",
            ", ".join(sorted(set(skipped))),
        )
    if not out:
        raise bad_request("input must hold at least one message or tool output", "input")
    return out
