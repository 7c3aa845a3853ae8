"""What one request/response pair says: its API, usage, first content event and prompt.

Pure functions over the bytes the proxy saw, so the tests can feed them hand-written
bodies of each API. Three usage shapes (each API's own definition of the prompt):

    Anthropic  /v1/messages    input_tokens + cache_read_input_tokens + cache_creation_input_tokens;
                               cached = cache_read_input_tokens
    Chat       /v1/chat/...    prompt_tokens; cached = prompt_tokens_details.cached_tokens
    Responses  /v1/responses   input_tokens; cached = input_tokens_details.cached_tokens
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# SSE events whose arrival means the model produced something (the TTFT a user feels).
CONTENT_EVENTS = {
    "content_block_delta",  # Anthropic
    "response.output_text.delta",  # Responses
    "response.reasoning_text.delta",
    "response.reasoning_summary_text.delta",
    "response.function_call_arguments.delta",
    "response.output_item.added",
}


def api_of(path: str) -> str:
    """ "anthropic", "responses", "chat", "completions" or "other", from the URL path."""
    path = path.split("?", 1)[0].rstrip("/")
    if path.endswith("/messages"):
        return "anthropic"
    if path.endswith("/responses"):
        return "responses"
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "completions"
    return "other"


def sse_events(body: bytes) -> Iterator[tuple[str | None, Any]]:
    """(event name, parsed data) of each event of an SSE body; data that is not JSON
    comes back as its text (e.g. "[DONE]")."""
    for block in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        name, data = None, []
        for line in block.decode("utf-8", "replace").split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if not data:
            continue
        text = "\n".join(data)
        try:
            yield name, json.loads(text)
        except ValueError:
            yield name, text


def is_content_event(name: str | None, data: Any) -> bool:
    """Whether an SSE event carries generated content (text, reasoning or a tool call)."""
    if not isinstance(data, dict):
        return False
    kind = name or data.get("type")
    if kind in CONTENT_EVENTS:
        return True
    for choice in data.get("choices") or ():  # Chat / Completions chunks
        delta = choice.get("delta") or {}
        if choice.get("text") or any(
            delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")
        ):
            return True
    return False


@dataclass(frozen=True)
class Usage:
    """The prompt size an API reports, by its own definition, and how much was cached."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def usage_of(usage: dict) -> Usage:
    """One usage object, whichever API's shape it has."""
    if "prompt_tokens" in usage:  # Chat / Completions
        details = usage.get("prompt_tokens_details") or {}
        return Usage(
            _int(usage["prompt_tokens"]),
            _int(details.get("cached_tokens")),
            _int(usage.get("completion_tokens")),
        )
    if "input_tokens_details" in usage:  # Responses
        details = usage.get("input_tokens_details") or {}
        return Usage(
            _int(usage.get("input_tokens")),
            _int(details.get("cached_tokens")),
            _int(usage.get("output_tokens")),
        )
    parts = [
        _int(usage.get(k))
        for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    ]
    known = [p for p in parts if p is not None]
    return Usage(
        sum(known) if known else None,
        _int(usage.get("cache_read_input_tokens")),
        _int(usage.get("output_tokens")),
    )


def _usage_objects(obj: Any) -> Iterator[dict]:
    """The usage objects of a response or event: top level, message (Anthropic's
    message_start), response (Responses' response.completed)."""
    if not isinstance(obj, dict):
        return
    for holder in (obj, obj.get("message"), obj.get("response")):
        if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
            yield holder["usage"]


def merge(old: Usage, new: Usage) -> Usage:
    """Later usage reports win field by field (Anthropic's message_delta repeats only some)."""
    return Usage(
        new.prompt_tokens if new.prompt_tokens is not None else old.prompt_tokens,
        new.cached_tokens if new.cached_tokens is not None else old.cached_tokens,
        new.output_tokens if new.output_tokens is not None else old.output_tokens,
    )


def response_usage(body: bytes, content_type: str) -> Usage:
    """The usage a response body reports (JSON or SSE), or an empty Usage."""
    found = Usage()
    if "text/event-stream" in content_type:
        for _, data in sse_events(body):
            for usage in _usage_objects(data):
                found = merge(found, usage_of(usage))
        return found
    try:
        obj = json.loads(body)
    except ValueError:
        return found
    for usage in _usage_objects(obj):
        found = merge(found, usage_of(usage))
    return found


def error_line(body: bytes, limit: int = 200) -> str:
    """The first line of an error body: the message of {"error": {"message"}} shapes
    (OpenAI, Anthropic), else the text."""
    text = body.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict) and err.get("message"):
            text = str(err["message"])
        elif isinstance(err, str):
            text = err
        elif obj.get("detail"):
            text = json.dumps(obj["detail"])
    lines = text.strip().splitlines()
    return (lines[0] if lines else "")[:limit]


def prompt_parts(api: str, request: dict) -> list[str]:
    """The prompt of a request as a list of canonical JSON strings: system first, then one
    per message (Anthropic, Chat) or input item (Responses). Tools are left out: they are
    the same every turn and would only hide where the conversation changed."""
    parts: list[Any] = []
    if api == "anthropic":
        parts.append({"system": request.get("system")})
        parts += request.get("messages") or []
    elif api == "responses":
        parts.append({"instructions": request.get("instructions")})
        items = request.get("input")
        parts += [{"role": "user", "content": items}] if isinstance(items, str) else items or []
    elif api == "chat":
        parts += request.get("messages") or []
    elif api == "completions":
        parts.append(request.get("prompt"))
    return [json.dumps(p, sort_keys=True, ensure_ascii=False) for p in parts]


def session_key(api: str, parts: list[str]) -> str:
    """Requests of one conversation share their API and their first part (the system
    prompt); a client's side requests (titles, summaries) have other system prompts."""
    head = parts[0] if parts else ""
    return f"{api}:{hashlib.sha1(head.encode()).hexdigest()[:12]}"


def prompt_diff(before: list[str], after: list[str], context: int = 40) -> dict:
    """Where ``after``'s prompt first departs from ``before``'s: the part (message) index,
    the char offset inside it, and a little text of both sides there. ``extends`` is true
    when ``after`` starts with all of ``before`` (what a prefix cache wants)."""
    for index, (a, b) in enumerate(zip(before, after, strict=False)):
        if a != b:
            offset = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            lo = max(0, offset - context // 2)
            return {
                "extends": False,
                "index": index,
                "offset": offset,
                "before": a[lo : offset + context],
                "after": b[lo : offset + context],
                "parts": [len(before), len(after)],
            }
    if len(after) >= len(before):
        return {
            "extends": True,
            "index": len(before),
            "offset": 0,
            "parts": [len(before), len(after)],
        }
    return {
        "extends": False,
        "index": len(after),
        "offset": 0,
        "before": before[len(after)][:context],
        "after": "",
        "parts": [len(before), len(after)],
    }
