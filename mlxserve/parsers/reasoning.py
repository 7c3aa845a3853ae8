"""Reasoning in ``<think>...</think>``, split from the answer (vLLM's reasoning_content).

    <think>
    The user wants the capital of France.
    </think>

    The capital of France is Paris.

-> reasoning_content "The user wants the capital of France.", content "The capital of
France is Paris." Whitespace around the reasoning and before the answer is dropped.

Where the reply starts depends on the prompt: DeepSeek-R1 distills' templates open the
``<think>`` themselves (the output has only ``</think>``); Qwen3 and SmolLM3 write both
tags, and with thinking turned off their templates close an empty block in the prompt.
"""

from __future__ import annotations

from typing import ClassVar

from mlxserve.parsers.base import ParsedDelta, partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"


def prompt_opens_reasoning(prompt: str) -> bool | None:
    """True if the prompt ends inside a <think> block, False if it closes the last one,
    None if it has none (the parser's default decides)."""
    at = prompt.rfind(THINK_START)
    if at < 0:
        return None
    return THINK_END not in prompt[at:]


class ReasoningParser:
    """Splits ``<think>`` reasoning from content, incrementally (see the module doc)."""

    name: ClassVar[str] = "qwen3"
    start_tag: ClassVar[str] = THINK_START
    end_tag: ClassVar[str] = THINK_END
    # The model is already reasoning when its reply starts (the template opened it).
    starts_in_reasoning: ClassVar[bool] = False

    def __init__(self, prompt: str | None = None) -> None:
        opened = prompt_opens_reasoning(prompt) if prompt is not None else None
        in_reasoning = self.starts_in_reasoning if opened is None else opened
        self._mode = "reasoning" if in_reasoning else "start"
        self._skip_space = in_reasoning
        self.buffer = ""
        self._held = ""  # trailing whitespace of the reasoning, sent if more follows

    @property
    def is_reasoning_done(self) -> bool:
        """True once the reply is past its reasoning (or turned out to have none)."""
        return self._mode == "content"

    def feed(self, text: str) -> ParsedDelta:
        """Take the next piece of output; the reasoning and content it lets us send."""
        self.buffer += text
        return self._advance(final=False)

    def finish(self) -> ParsedDelta:
        """The output has ended: send what is held back."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if self._skip_space:
                self.buffer = self.buffer.lstrip()
                if not self.buffer and not final:
                    return out
                self._skip_space = False
            if self._mode == "content":
                out.content += self.buffer
                self.buffer = ""
                return out
            if self._mode == "start":
                head = self.buffer.lstrip()
                if head.startswith(self.start_tag):
                    self.buffer = head[len(self.start_tag) :]
                    self._mode, self._skip_space = "reasoning", True
                    continue
                if not final and self.start_tag.startswith(head):
                    return out  # maybe the start of <think>
                self._mode = "content"
                continue
            # reasoning
            at = self.buffer.find(self.end_tag)
            if at >= 0:
                last = self.buffer[:at].rstrip()
                if last:
                    out.reasoning_content += self._held + last
                self._held = ""
                self.buffer = self.buffer[at + len(self.end_tag) :]
                self._mode, self._skip_space = "content", True
                continue
            keep = 0 if final else partial_suffix(self.buffer, self.end_tag)
            text = self.buffer[: len(self.buffer) - keep]
            self.buffer = self.buffer[len(text) :]
            stripped = text.rstrip()
            if stripped:
                out.reasoning_content += self._held + stripped
                self._held = text[len(stripped) :]
            else:
                self._held += text
            if final:
                self._held = ""
            return out


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills: the template opens <think>, the reply closes it."""

    name = "deepseek_r1"
    starts_in_reasoning = True


class SmolLM3ReasoningParser(ReasoningParser):
    """SmolLM3: as Qwen3 (``/no_think`` or enable_thinking=false closes it in the prompt)."""

    name = "smollm3"
