"""What the output parsers produce, and the incremental machinery they share.

A parser reads a model's output text as it arrives (``feed``), then ``finish``es, and
returns ParsedDeltas: content, reasoning and tool calls. The same parser fed the whole
text at once gives the non-streamed result, so streamed and non-streamed responses are
built by one piece of code and cannot disagree, whatever the chunking.

A tool call is sent whole (id, name, all its arguments) once its text is complete and
parses: a call the model wrote badly comes back as the text it wrote, as content,
streamed or not. API-neutral: nothing here knows an HTTP API; the server's OpenAI chat
endpoint formats the deltas (server/chat_tools.py), and any other front-end can.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ToolCall:
    """One complete function call: its id, the function's name, the arguments as JSON."""

    id: str
    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """A tool call's part in a stream: the first delta of call ``index`` has its id and
    name; arguments are fragments to concatenate."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """What one piece of output text adds: content, reasoning, tool call deltas."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.reasoning_content += other.reasoning_content
        self.tool_calls += other.tool_calls
        return self

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


@dataclass
class ParsedMessage:
    """A whole output, parsed: what a non-streamed response carries."""

    content: str
    reasoning_content: str
    tool_calls: list[ToolCall]


def aggregate(deltas: list[ParsedDelta]) -> ParsedMessage:
    """Fold a stream of deltas into the message they add up to (a client's view)."""
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning_content for d in deltas)
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        for tc in d.tool_calls:
            call = calls.setdefault(tc.index, ToolCall("", "", ""))
            call.id = tc.id or call.id
            call.name = tc.name or call.name
            call.arguments += tc.arguments
    return ParsedMessage(content, reasoning, [calls[i] for i in sorted(calls)])


def make_tool_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def make_short_tool_call_id() -> str:
    """Nine letters and digits: the only tool call ids Mistral's chat templates accept."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back, since
    the next piece of text may complete the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def json_end(text: str, start: int) -> int | None:
    """End of the JSON object or array opening at ``text[start]``, None if not closed yet."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def arguments_json(value: Any) -> str | None:
    """A call's arguments as a JSON object text; None if they are not an object.

    Some models write the arguments as a string holding JSON: that is unwrapped.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


class ToolParser:
    """Finds a model's tool calls in its output text, incrementally.

    Subclasses implement ``_advance(final)``: consume what they can of ``self.buffer``
    and return what it adds. ``tools`` (OpenAI's tool list) lets a parser type the
    arguments of formats that write them as text.
    """

    name: ClassVar[str]
    # The format's markers are special tokens: decode the output with them kept.
    needs_special_tokens: ClassVar[bool] = False
    # The texts that frame a call; a vocabulary may hold each as one (special) token.
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.functions = {
            t["function"]["name"]: t["function"]
            for t in tools or []
            if isinstance(t, dict) and isinstance(t.get("function"), dict)
        }
        self.buffer = ""
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        """Take the next piece of output text; what it lets us send now."""
        self.buffer += text
        return self._advance(final=False)

    def finish(self) -> ParsedDelta:
        """The output has ended: send whatever is held back."""
        return self._advance(final=True)

    def parse(self, text: str) -> ParsedMessage:
        """A whole output at once (the non-streamed response)."""
        return aggregate([self.feed(text), self.finish()])

    def _advance(self, final: bool) -> ParsedDelta:
        raise NotImplementedError

    def _call(self, name: str, arguments: str, call_id: str | None = None) -> ToolCallDelta:
        delta = ToolCallDelta(self.num_calls, call_id or self.new_id(), name, arguments)
        self.num_calls += 1
        return delta

    def new_id(self) -> str:
        """A fresh id for a call the model did not name."""
        return make_tool_call_id()


class MarkedCallParser(ToolParser):
    """Tool calls after a start marker (``<tool_call>``), content around them. A call
    ends at ``end_marker``, or where ``call_end`` says. Whitespace between content and
    calls is dropped."""

    start_marker: ClassVar[str]
    end_marker: ClassVar[str] = ""

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._in_call = False
        self._held = ""  # whitespace before a possible call: dropped if a call follows
        self._skip_space = False  # just after a call: leading whitespace is dropped

    def call_end(self, text: str) -> tuple[int, int] | None:
        """(end of the call's text, end of what it uses up) in ``text``, which follows the
        start marker; None while the call is not complete."""
        at = text.find(self.end_marker)
        return None if at < 0 else (at, at + len(self.end_marker))

    def parse_calls(self, body: str) -> list[tuple] | None:
        """(name, arguments JSON[, id]) of the calls in a call's text; None if it does not
        parse as calls."""
        raise NotImplementedError

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if not self._in_call:
                if self._skip_space:
                    self.buffer = self.buffer.lstrip()
                    if not self.buffer:
                        return out
                    self._skip_space = False
                at = self.buffer.find(self.start_marker)
                if at < 0:
                    self._text(out, final)
                    return out
                self._hold(out, self.buffer[:at])
                self.buffer = self.buffer[at + len(self.start_marker) :]
                self._in_call = True
            ends = self.call_end(self.buffer)
            if ends is None and not final:
                return out
            body_end, used = ends or (len(self.buffer), len(self.buffer))
            body, written = self.buffer[:body_end], self.buffer[:used]
            self.buffer = self.buffer[used:]
            self._in_call = False
            calls = self.parse_calls(body)
            if calls is None:  # not a call after all: the text as written
                out.content += self._held + self.start_marker + written
            else:
                out.tool_calls += [self._call(*call) for call in calls]
                self._skip_space = True
            self._held = ""

    def _hold(self, out: ParsedDelta, text: str) -> None:
        """Send content, holding its trailing whitespace back (a call may follow it)."""
        stripped = text.rstrip()
        if stripped:
            out.content += self._held + stripped
            self._held = text[len(stripped) :]
        else:
            self._held += text

    def _text(self, out: ParsedDelta, final: bool) -> None:
        if final:
            rest = self._held + self.buffer
            # After a call, trailing whitespace is not content; without calls, the text
            # comes back exactly as written.
            out.content += rest.rstrip() if self.num_calls else rest
            self._held = self.buffer = ""
            return
        keep = len(self.buffer) - partial_suffix(self.buffer, self.start_marker)
        self._hold(out, self.buffer[:keep])
        self.buffer = self.buffer[keep:]
