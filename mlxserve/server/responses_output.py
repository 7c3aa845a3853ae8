"""A response's output items, built as the reply is parsed, with the stream events of each.

One builder serves both the JSON answer (its events are dropped) and the event stream, so
the two agree. Each item opens, grows and closes with the events the openai SDK defines::

    reasoning         output_item.added, content_part.added, reasoning_text.delta...,
                      [reasoning_summary_part.added, reasoning_summary_text.delta...  when a
                      summary was asked for], ..._done events, output_item.done
    message           output_item.added, content_part.added, output_text.delta...,
                      output_text.done, content_part.done, output_item.done
    function_call     output_item.added, function_call_arguments.delta/.done, output_item.done
    custom_tool_call  output_item.added, custom_tool_call_input.delta/.done, output_item.done
    local_shell_call  output_item.added, output_item.done

Every event carries ``sequence_number``, counting from 0 over the whole stream.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from mlxserve.parsers import ToolCall
from mlxserve.server.responses_input import (
    LOCAL_SHELL,
    ResponsesTools,
    custom_input,
    encode_reasoning,
)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [text_part(text)] if text or status == "completed" else []
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


class ResponseOutput:
    """The output items of one response and the events that build them."""

    def __init__(self, tools: ResponsesTools, summary: bool, encrypted: bool) -> None:
        self.tools = tools
        self.summary = summary  # reasoning.summary asked for: the reasoning is its summary
        self.encrypted = encrypted  # include has reasoning.encrypted_content
        self.output: list[dict[str, Any]] = []
        self.calls: list[ToolCall] = []  # as the model wrote them (flat names)
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the reasoning or message being written
        self._text = ""

    def event(self, kind: str, **data: Any) -> str:
        """One server-sent event with the next sequence number."""
        payload = {"type": kind, "sequence_number": self._seq} | data
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    @property
    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}

    def _start(self, item: dict[str, Any]) -> str:
        self.output.append(item)
        return self.event(
            "response.output_item.added", output_index=len(self.output) - 1, item=item
        )

    def reasoning(self, text: str) -> list[str]:
        """More reasoning text."""
        if not text:
            return []
        frames = []
        if self._open is None or self._open["type"] != "reasoning":
            frames += self.close()
            self._open = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": []}
            frames.append(self._start(dict(self._open)))
            part = {"type": "reasoning_text", "text": ""}
            frames.append(
                self.event("response.content_part.added", **self._where, content_index=0, part=part)
            )
            if self.summary:
                part = {"type": "summary_text", "text": ""}
                frames.append(
                    self.event(
                        "response.reasoning_summary_part.added",
                        **self._where,
                        summary_index=0,
                        part=part,
                    )
                )
        self._text += text
        frames.append(
            self.event("response.reasoning_text.delta", **self._where, content_index=0, delta=text)
        )
        if self.summary:
            frames.append(
                self.event(
                    "response.reasoning_summary_text.delta",
                    **self._where,
                    summary_index=0,
                    delta=text,
                )
            )
        return frames

    def text(self, text: str) -> list[str]:
        """More answer text."""
        if not text:
            return []
        frames = []
        if self._open is None or self._open["type"] != "message":
            frames += self.close()
            self._open = message_item(_id("msg"), "", "in_progress")
            frames.append(self._start(dict(self._open)))
            frames.append(
                self.event(
                    "response.content_part.added",
                    **self._where,
                    content_index=0,
                    part=text_part(""),
                )
            )
        self._text += text
        frames.append(
            self.event(
                "response.output_text.delta",
                **self._where,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return frames

    def call(self, call: ToolCall) -> list[str]:
        """One whole tool call, as the item its tool's type gives."""
        frames = self.close()
        self.calls.append(call)
        target = self.tools.target(call.name)
        index = len(self.output)
        if target.kind == "custom":
            text = custom_input(call.arguments)
            item = {
                "type": "custom_tool_call",
                "id": _id("ctc"),
                "call_id": call.id,
                "name": target.name,
                "input": text,
            }
            if target.namespace:
                item["namespace"] = target.namespace
            frames.append(self._start(item | {"input": ""}))
            where = {"item_id": item["id"], "output_index": index}
            frames.append(self.event("response.custom_tool_call_input.delta", **where, delta=text))
            frames.append(self.event("response.custom_tool_call_input.done", **where, input=text))
        elif target.kind == LOCAL_SHELL:
            item = _local_shell_call(call)
            frames.append(self._start(item | {"status": "in_progress"}))
        else:
            item = {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": call.id,
                "name": target.name,
                "arguments": call.arguments,
                "status": "completed",
            }
            if target.namespace:
                item["namespace"] = target.namespace
            frames.append(self._start(item | {"arguments": "", "status": "in_progress"}))
            where = {"item_id": item["id"], "output_index": index}
            frames.append(
                self.event("response.function_call_arguments.delta", **where, delta=call.arguments)
            )
            frames.append(
                self.event(
                    "response.function_call_arguments.done", **where, arguments=call.arguments
                )
            )
        self.output[index] = item
        frames.append(self.event("response.output_item.done", output_index=index, item=item))
        return frames

    def close(self) -> list[str]:
        """Close the reasoning or message being written."""
        item, text = self._open, self._text
        if item is None:
            return []
        self._open, self._text = None, ""
        index = len(self.output) - 1
        where = {"item_id": item["id"], "output_index": index}
        frames = []
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            frames.append(
                self.event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
            frames.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
            item["content"] = [part]
            if self.summary:
                summary = {"type": "summary_text", "text": text}
                frames.append(
                    self.event(
                        "response.reasoning_summary_text.done", **where, summary_index=0, text=text
                    )
                )
                frames.append(
                    self.event(
                        "response.reasoning_summary_part.done",
                        **where,
                        summary_index=0,
                        part=summary,
                    )
                )
                item["summary"] = [summary]
            if self.encrypted:
                item["encrypted_content"] = encode_reasoning(text)
        else:
            frames.append(
                self.event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
            )
            frames.append(
                self.event(
                    "response.content_part.done", **where, content_index=0, part=text_part(text)
                )
            )
            item["content"] = [text_part(text)]
        item["status"] = "completed"
        self.output[index] = item
        frames.append(self.event("response.output_item.done", output_index=index, item=item))
        return frames

    def finish(self) -> list[str]:
        """Close what is open; an empty reply is one empty message."""
        frames = self.close()
        if not self.output:
            item = message_item(_id("msg"), "", "completed")
            frames.append(self._start(item))
            frames.append(self.event("response.output_item.done", output_index=0, item=item))
        return frames

    def reasoning_text(self) -> str:
        return "\n\n".join(
            p["text"]
            for item in self.output
            if item["type"] == "reasoning"
            for p in item["content"]
        )

    def message_text(self) -> str:
        return "".join(
            p["text"] for item in self.output if item["type"] == "message" for p in item["content"]
        )


def _local_shell_call(call: ToolCall) -> dict[str, Any]:
    try:
        args = json.loads(call.arguments)
    except ValueError:
        args = {}
    args = args if isinstance(args, dict) else {}
    command = args.get("command")
    if isinstance(command, str):
        command = [command]
    action = {
        "type": "exec",
        "command": [str(c) for c in command] if isinstance(command, list) else [],
        "env": {str(k): str(v) for k, v in (args.get("env") or {}).items()}
        if isinstance(args.get("env"), dict)
        else {},
    }
    for key in ("working_directory", "timeout_ms", "user"):
        if args.get(key) is not None:
            action[key] = args[key]
    return {
        "type": "local_shell_call",
        "id": _id("lsc"),
        "call_id": call.id,
        "action": action,
        "status": "completed",
    }
