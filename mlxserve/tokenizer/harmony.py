"""gpt-oss's "harmony" chat format: OpenAI-style messages -> the prompt text.

    <|start|>system<|message|>You are ChatGPT, ...Reasoning: medium ...<|end|>
    <|start|>developer<|message|># Instructions ... # Tools ... namespace functions {...}<|end|>
    <|start|>user<|message|>What is the weather in SF?<|end|>
    <|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json
        <|message|>{"city": "SF"}<|call|>                (one line in the prompt)
    <|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 20}<|end|>
    <|start|>assistant                                   <- the generation prompt

Rendered as the ``openai-harmony`` package renders a conversation for completion (its
default config: reasoning before the last final answer is dropped), which the tests use
as the oracle. Mapping from OpenAI chat messages (as vLLM and the gpt-oss chat template):
system/developer messages -> the developer message's instructions; an assistant's
``reasoning_content`` (or ``thinking``) -> its analysis channel, its content -> final,
its ``tool_calls`` -> commentary messages to ``functions.NAME``; a ``tool`` message ->
a message from ``functions.NAME`` (named by the call it answers) to the assistant.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
REASONING_EFFORTS = ("low", "medium", "high")
CHANNELS = ("analysis", "commentary", "final")
# The vocabulary's markers of the format (o200k_harmony): a tokenizer that has them all speaks
# harmony, so its chats are rendered here rather than by its Jinja template.
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
# The ones a reply keeps when special tokens are skipped (as llama.cpp decodes gpt-oss): the
# message headers and ends between its messages, which the output parser reads.
HARMONY_TEXT_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>")


def _message(header: str, body: str, end: str = "<|end|>") -> str:
    return f"<|start|>{header}<|message|>{body}{end}"


def system_message(
    reasoning_effort: str = "medium",
    current_date: str | None = None,
    model_identity: str = MODEL_IDENTITY,
    has_functions: bool = False,
) -> str:
    """The harmony system message (identity, dates, reasoning effort, channels)."""
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(
            f"reasoning_effort {reasoning_effort!r} is not one of {', '.join(REASONING_EFFORTS)}"
        )
    lines = [model_identity, f"Knowledge cutoff: {KNOWLEDGE_CUTOFF}"]
    if current_date:
        lines.append(f"Current date: {current_date}")
    text = "\n".join(lines) + f"\n\nReasoning: {reasoning_effort}\n\n"
    text += f"# Valid channels: {', '.join(CHANNELS)}. Channel must be included for every message."
    if has_functions:
        text += "\nCalls to these tools must go to the commentary channel: 'functions'."
    return _message("system", text)


def developer_message(instructions: str | None, tools: Sequence[Mapping[str, Any]] | None) -> str:
    """The developer message: instructions, then the function tools as TypeScript."""
    parts = []
    if instructions:
        parts.append(f"# Instructions\n\n{instructions}")
    if tools:
        parts.append("# Tools\n\n## functions\n\n" + functions_namespace(tools))
    return _message("developer", "\n\n".join(parts)) if parts else ""


def functions_namespace(tools: Sequence[Mapping[str, Any]]) -> str:
    """OpenAI function tools as harmony's ``namespace functions { ... }`` block."""
    out = "namespace functions {\n\n"
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools: a function tool needs a name, got {tool!r}")
        for line in (fn.get("description") or "").splitlines():
            out += f"// {line}\n"
        params = fn.get("parameters")
        if params is None:
            out += f"type {fn['name']} = () => any;\n\n"
        else:
            out += f"type {fn['name']} = (_: {_object(params, 0)}) => any;\n\n"
    return out + "} // namespace functions"


def _object(schema: Mapping[str, Any], depth: int) -> str:
    """``{`` properties ``}`` with harmony's indentation (4 spaces per nesting level)."""
    pad = "    " * depth
    required = set(schema.get("required") or ())
    out = "{\n"
    for name, prop in (schema.get("properties") or {}).items():
        prop = prop if isinstance(prop, Mapping) else {}
        if "oneOf" not in prop:
            for line in (prop.get("description") or "").splitlines():
                out += f"{pad}// {line}\n"
        mark = "" if name in required else "?"
        out += f"{pad}{name}{mark}:{_type(prop, depth + 1)},"
        if "default" in prop:
            out += f" // default: {_default(prop['default'])}"
        out += "\n"
    return out + f"{pad}}}"


def _type(schema: Mapping[str, Any], depth: int) -> str:
    """A property's TypeScript type, with the space that follows the colon."""
    if "oneOf" in schema:  # one line per variant, each with its description
        lines = ""
        for variant in schema["oneOf"]:
            comment = f" // {variant['description']}" if variant.get("description") else ""
            lines += f"\n | {_plain_type(variant, depth)}{comment}"
        return lines + "\n"
    return " " + _plain_type(schema, depth)


def _plain_type(schema: Mapping[str, Any], depth: int) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_plain_type({**schema, "type": k}, depth) for k in kind)
    if kind == "string" and "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    if kind == "string":
        return "string"
    if kind in ("number", "integer"):
        return "number"
    if kind in ("boolean", "null"):
        return kind
    if kind == "array":
        items = schema.get("items")
        return f"{_plain_type(items, depth) if isinstance(items, Mapping) else 'any'}[]"
    if kind == "object":
        return _object(schema, depth)
    return "any"


def _default(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def render_harmony(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    reasoning_effort: str = "medium",
    current_date: str | None = None,
    model_identity: str = MODEL_IDENTITY,
) -> str:
    """OpenAI chat messages (and function tools) -> the harmony prompt text."""
    if isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    instructions = [
        _text(m) for m in messages if m.get("role") in ("system", "developer") and _text(m)
    ]
    out = system_message(reasoning_effort, current_date, model_identity, bool(tools))
    out += developer_message("\n\n".join(instructions) or None, tools)
    calls: dict[str, str] = {}  # tool_call id -> function name
    turns = [m for m in messages if m.get("role") not in ("system", "developer")]
    last_final = max(
        (i for i, m in enumerate(turns) if m.get("role") == "assistant" and _text(m)), default=-1
    )
    for i, m in enumerate(turns):
        role = m.get("role")
        if role == "user":
            out += _message("user", _text(m))
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("thinking")
            if reasoning and i > last_final:  # reasoning before the last answer is dropped
                out += _message("assistant<|channel|>analysis", reasoning)
            for call in m.get("tool_calls") or ():
                fn = call.get("function", call)
                args = fn.get("arguments", "{}")
                args = args if isinstance(args, str) else json.dumps(args)
                calls[call.get("id", "")] = fn["name"]
                header = (
                    f"assistant to=functions.{fn['name']}<|channel|>commentary <|constrain|>json"
                )
                out += _message(header, args, "<|call|>")
            if _text(m):
                out += _message("assistant<|channel|>final", _text(m))
        elif role == "tool":
            name = m.get("name") or calls.get(m.get("tool_call_id", ""))
            if not name:
                raise ValueError("a tool message must name its function or answer a known call")
            out += _message(f"functions.{name} to=assistant<|channel|>commentary", _text(m))
        else:
            raise ValueError(f"messages: role {role!r} is not supported in the harmony format")
    return out + ("<|start|>assistant" if add_generation_prompt else "")


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
