"""OutputParser: reasoning first, then tool calls in what follows it; one object per sample."""

from __future__ import annotations

from mlxserve.parsers.base import ParsedDelta, ParsedMessage, ToolParser, aggregate
from mlxserve.parsers.reasoning import ReasoningParser


class OutputParser:
    """Splits one sample's output text into reasoning, content and tool calls.

    Either parser may be missing (no reasoning parser: all text is the answer; no tool
    parser: the answer is all content). ``calls_only``: a grammar lets the answer be
    nothing but calls, so text that is not a finished call (one cut by max_tokens) is not
    content either.
    """

    def __init__(
        self,
        reasoning: ReasoningParser | None = None,
        tools: ToolParser | None = None,
        calls_only: bool = False,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.calls_only = calls_only

    def feed(self, text: str) -> ParsedDelta:
        """The next piece of output text; what can be sent now."""
        return self._pass(self.reasoning.feed(text) if self.reasoning else ParsedDelta(text))

    def finish(self) -> ParsedDelta:
        """The output has ended; what was held back."""
        out = self._pass(self.reasoning.finish() if self.reasoning else ParsedDelta())
        if self.tools is not None:
            out += self._answer(self.tools.finish())
        return out

    def parse(self, text: str) -> ParsedMessage:
        """A whole output at once (a non-streamed response)."""
        return aggregate([self.feed(text), self.finish()])

    def _pass(self, delta: ParsedDelta) -> ParsedDelta:
        if self.tools is None or not delta.content:
            return delta
        out = self._answer(self.tools.feed(delta.content))
        out.reasoning_content = delta.reasoning_content + out.reasoning_content
        return out

    def _answer(self, delta: ParsedDelta) -> ParsedDelta:
        if self.calls_only:
            delta.content = ""
        return delta
