"""gpt-oss's output in the harmony format -> reasoning, content and tool calls, incrementally.

The reply to ``...<|start|>assistant`` is a sequence of messages::

    <|channel|>analysis<|message|>The user wants ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "SF"}<|call|>                (one line in the output)
    ... or <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

analysis -> ``reasoning_content``; final (and commentary addressed to no one: a preamble
for the user) -> ``content``; a message addressed ``to=functions.NAME`` (in its header,
before or after the channel) -> a tool call NAME with the body as its arguments. The
output must be decoded with special tokens kept. Text is sent as it arrives (a possible
start of a special token held back); a tool call is sent whole when its message ends.

The deltas are the output parsers' ParsedDelta (content, reasoning_content, and
ToolCallDelta's index / id / name / arguments), so a harmony reply goes through the same
formatting as every other model's reasoning and tool calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlxserve.parsers.base import ParsedDelta, ToolCallDelta, make_tool_call_id

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")


@dataclass(frozen=True)
class Header:
    """A message's header: its channel and recipient (None when absent)."""

    channel: str | None
    recipient: str | None

    @staticmethod
    def parse(text: str) -> Header:
        """``assistant to=functions.f<|channel|>commentary <|constrain|>json`` -> fields."""
        channel = None
        if CHANNEL in text:
            channel = text.split(CHANNEL, 1)[1].split(CONSTRAIN)[0].split()[0:1]
            channel = channel[0] if channel else None
        m = _RECIPIENT.search(text)
        return Header(channel, m.group(1) if m else None)


def _partial_special(text: str) -> int:
    """Length of the end of ``text`` that may begin a special token (``<|...``)."""
    at = text.rfind("<|")
    if at >= 0 and "|>" not in text[at:]:
        return len(text) - at
    return 1 if text.endswith("<") else 0


class HarmonyParser:
    """Splits one sample's harmony output (special tokens kept) into deltas."""

    name = "harmony"
    needs_special_tokens = True

    def __init__(self) -> None:
        self.buffer = ""
        self._mode = "header"  # "header" (until <|message|>) | "body" | "done"
        self._header = Header(None, None)
        self._body = ""  # a tool call's arguments so far
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        """The next piece of output text; what can be sent now."""
        self.buffer += text
        return self._advance(final=False)

    def finish(self) -> ParsedDelta:
        """The output has ended: send what is held back (an unfinished call is sent too)."""
        out = self._advance(final=True)
        if self._mode == "body" and self._header.recipient is not None:
            out.tool_calls.append(self._call())
        elif self._mode == "header" and self.buffer:  # text outside any message: as written
            out.content += self.buffer
            self.buffer = ""
        return out

    def parse(self, text: str) -> ParsedDelta:
        """A whole output at once."""
        out = self.feed(text)
        out += self.finish()
        return out

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while self.buffer:
            if self._mode == "header":
                at = self.buffer.find(MESSAGE)
                if at < 0:
                    return out
                self._header = Header.parse(self.buffer[:at])
                self.buffer, self._mode, self._body = self.buffer[at + len(MESSAGE) :], "body", ""
                continue
            ends = [(i, e) for e in ENDS if (i := self.buffer.find(e)) >= 0]
            if ends:
                at, end = min(ends)
                self._emit(out, self.buffer[:at])
                if self._header.recipient is not None:
                    out.tool_calls.append(self._call())
                self.buffer = self.buffer[at + len(end) :]
                self._mode = "header"
                start = self.buffer.find(START)  # the next message's role follows <|start|>
                if start >= 0:
                    self.buffer = self.buffer[start + len(START) :]
                continue
            keep = 0 if final else _partial_special(self.buffer)
            self._emit(out, self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return out
        return out

    def _emit(self, out: ParsedDelta, text: str) -> None:
        if self._header.recipient is not None:
            self._body += text
        elif self._header.channel == "analysis":
            out.reasoning_content += text
        else:  # final, or a commentary preamble addressed to the user
            out.content += text

    def _call(self) -> ToolCallDelta:
        recipient = self._header.recipient or ""
        name = recipient.removeprefix("functions.")
        call = ToolCallDelta(self.num_calls, make_tool_call_id(), name, self._body)
        self.num_calls += 1
        self._body = ""
        self._header = Header(None, None)
        return call
