"""Anthropic ``messages`` (content blocks, mid-conversation system turns) as OpenAI chat messages,
and the ``context_management`` edits applied to them.

    text, search_result, text documents      -> text
    tool_use (assistant) / tool_result (user) -> assistant ``tool_calls`` / ``tool`` messages
    thinking (assistant)                      -> ``reasoning_content`` (templates that show
                                                 earlier reasoning read it), unless cleared
    redacted_thinking, server_tool_use        -> left out (nothing a local model can read)
    *_tool_result of server tools, compaction -> their readable content, as text
    image, PDF / URL documents                -> 400 naming the block (the model cannot see them)
    role "system" inside messages             -> a system message in place (rendered where the
                                                 template allows, else as a user-side note)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mlxserve.server.errors import bad_request

CLEARED_TOOL_RESULT = "[tool result cleared to save context]"
# Keys of server-tool blocks that carry nothing readable (ids, opaque payloads).
_OPAQUE_KEYS = {"type", "id", "tool_use_id", "cache_control", "encrypted_content", "signature"}


@dataclass
class ContextEdits:
    """What ``context_management`` edits did, for the response's ``applied_edits``."""

    cleared_thinking_turns: int = 0
    cleared_thinking: list[str] = field(default_factory=list)  # the texts (for token counts)
    cleared_tool_uses: int = 0
    cleared_tool_text: list[str] = field(default_factory=list)


def _block_text(block: dict[str, Any], where: str) -> str:
    """The readable text of a content block that is not a turn's own text."""
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "image":
        raise bad_request(
            f"{where}: this model cannot see images (type 'image'); send the image's "
            "content as text",
            where,
        )
    if kind == "document":
        source = block.get("source") or {}
        title = block.get("title")
        head = f"{title}\n\n" if isinstance(title, str) and title else ""
        if source.get("type") == "text":
            return head + str(source.get("data", ""))
        if source.get("type") == "content":
            content = source.get("content")
            if isinstance(content, str):
                return head + content
            parts = [_block_text(b, f"{where}.source.content.{j}") for j, b in enumerate(content)]
            return head + "\n".join(parts)
        raise bad_request(
            f"{where}: documents of source type {source.get('type')!r} (PDF, URL, file) "
            "cannot be read by this server; send the document as text",
            where,
        )
    if kind == "search_result":
        content = block.get("content") or []
        texts = [str(b.get("text", "")) for b in content if isinstance(b, dict)]
        return "\n".join([f"{block.get('title', '')} ({block.get('source', '')})", *texts])
    if kind == "compaction":
        return str(block.get("content") or "")
    if isinstance(kind, str) and kind.endswith("_tool_result"):
        readable = {k: v for k, v in block.items() if k not in _OPAQUE_KEYS}
        return f"[{kind}] {json.dumps(readable, ensure_ascii=False)}"
    raise bad_request(f"{where}.type: content blocks of type {kind!r} are not supported", where)


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(_block_text(b, f"{where}.{j}") for j, b in enumerate(content))


def _system_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    # Tool addition / removal blocks change Anthropic's tool list: nothing to render.
    texts = [str(b.get("text", "")) for b in content or () if b.get("type") == "text"]
    return "\n\n".join(t for t in texts if t)


def anthropic_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic turns as OpenAI chat messages (see the module doc)."""
    out: list[dict[str, Any]] = []
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "system":
            if message.get("clear_at") == "next_user_message" and i < last_user:
                continue  # shown only until the next user turn
            out.append({"role": "system", "content": _system_text(content)})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        thinking: list[str] = []
        for j, block in enumerate(content):
            where = f"messages.{i}.content.{j}"
            kind = block.get("type")
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
                function = {"name": str(block.get("name")), "arguments": arguments}
                calls.append({"id": str(block.get("id")), "type": "function", "function": function})
            elif kind == "tool_result" and role == "user":
                result = _result_text(block.get("content"), where + ".content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": str(block.get("tool_use_id")),
                        "content": result,
                    }
                )
            elif kind == "thinking" and role == "assistant":
                thinking.append(str(block.get("thinking", "")))
            elif kind in ("redacted_thinking", "server_tool_use", "mcp_tool_use"):
                continue  # opaque, or a call the server side already answered
            elif kind in ("tool_reference", "container_upload", "fallback"):
                continue
            else:
                texts.append(_block_text(block, where))
        if role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                turn["tool_calls"] = calls
            if thinking:
                turn["reasoning_content"] = "\n\n".join(thinking)
            if not calls:
                turn["content"] = turn["content"] or ""
            out.append(turn)
        elif texts:
            out.append({"role": role, "content": "\n\n".join(texts)})
    return out


def clear_thinking(messages: list[dict[str, Any]], keep: Any, edits: ContextEdits) -> None:
    """clear_thinking_20251015: drop the reasoning of all but the last ``keep`` assistant
    turns that have some (``keep``: "all", {"type": "all"} or {"type": "thinking_turns",
    "value": N}; default 1)."""
    if keep == "all" or (isinstance(keep, dict) and keep.get("type") == "all"):
        return
    num_keep = keep.get("value", 1) if isinstance(keep, dict) else 1
    if not isinstance(num_keep, int) or num_keep < 0:
        raise bad_request(
            "context_management.edits.keep.value: Input should be a non-negative integer",
            "context_management",
        )
    turns = [m for m in messages if m["role"] == "assistant" and m.get("reasoning_content")]
    for m in turns[: max(len(turns) - num_keep, 0)]:
        edits.cleared_thinking.append(m.pop("reasoning_content"))
        edits.cleared_thinking_turns += 1


def clear_tool_uses(
    messages: list[dict[str, Any]], edit: dict[str, Any], num_input_tokens: int, edits: ContextEdits
) -> None:
    """clear_tool_uses_20250919: once the prompt passes ``trigger``, replace the results of the
    oldest tool uses (all but the last ``keep``, none of ``exclude_tools``) with a placeholder;
    with ``clear_tool_inputs`` also the calls' inputs."""
    calls = [
        (m, c) for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or ()
    ]
    trigger = edit.get("trigger") or {"type": "input_tokens", "value": 100_000}
    measure = num_input_tokens if trigger.get("type") == "input_tokens" else len(calls)
    if measure <= int(trigger.get("value", 0)):
        return
    keep = (edit.get("keep") or {"value": 3}).get("value", 3)
    exclude = set(edit.get("exclude_tools") or ())
    clear_inputs = edit.get("clear_tool_inputs") or False
    results = {m["tool_call_id"]: m for m in messages if m["role"] == "tool"}
    for _, call in calls[: max(len(calls) - keep, 0)]:
        name = call["function"]["name"]
        if name in exclude:
            continue
        result = results.get(call["id"])
        if result is not None and result["content"] != CLEARED_TOOL_RESULT:
            edits.cleared_tool_text.append(result["content"])
            result["content"] = CLEARED_TOOL_RESULT
        if clear_inputs is True or (isinstance(clear_inputs, list) and name in clear_inputs):
            edits.cleared_tool_text.append(call["function"]["arguments"])
            call["function"]["arguments"] = "{}"
        edits.cleared_tool_uses += 1
