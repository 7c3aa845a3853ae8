"""ChatSession: the terminal chat behind `mlxserve run` (streaming, history, commands)."""

from __future__ import annotations

import itertools
import sys
from typing import TextIO

from mlxserve.config import EngineConfig
from mlxserve.engine import LLMEngine
from mlxserve.sampling_params import SamplingParams

HELP = "Commands: /clear forgets the conversation, /exit quits (or Ctrl-D). Ctrl-C stops an answer."


class ChatSession:
    """A conversation with one model; each answer streams as it is generated."""

    def __init__(
        self,
        engine: LLMEngine,
        params: SamplingParams,
        system: str | None = None,
        use_chat_template: bool = True,
    ) -> None:
        self.engine = engine
        self.params = params
        self.system = system
        self.use_chat_template = use_chat_template and engine.tokenizer.chat_template is not None
        self.messages: list[dict[str, str]] = []
        self._ids = itertools.count()
        self.clear()

    @classmethod
    def load(cls, config: EngineConfig, params: SamplingParams, **kw) -> ChatSession:
        print(f"Loading {config.model or 'the default model'} ...", file=sys.stderr, flush=True)
        return cls(LLMEngine(config), params, **kw)

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _prompt_ids(self) -> list[int]:
        tok = self.engine.tokenizer
        if self.use_chat_template:
            return tok.encode_chat(self.messages, add_generation_prompt=True)
        # Raw completion: the whole transcript as plain text.
        return tok.encode("\n".join(m["content"] for m in self.messages))

    def answer(self, user_text: str, out: TextIO) -> str:
        """Stream the reply to ``user_text`` into ``out``; keeps both in the history.

        Ctrl-C stops this answer only: the partial reply is kept, the session goes on.
        """
        self.messages.append({"role": "user", "content": user_text})
        rid = f"chat-{next(self._ids)}"
        try:
            self.engine.add_request(rid, None, self.params, prompt_token_ids=self._prompt_ids())
        except ValueError:
            self.messages.pop()
            raise
        parts: list[str] = []
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step(delta=True):
                    delta = output.outputs[0].text
                    if delta:
                        parts.append(delta)
                        out.write(delta)
                        out.flush()
        except KeyboardInterrupt:
            self.engine.abort_request(rid)
            out.write(" [stopped]")
        out.write("\n")
        out.flush()
        reply = "".join(parts)
        self.messages.append({"role": "assistant", "content": reply})
        return reply

    def repl(self, inp: TextIO, out: TextIO) -> None:
        """Read-answer loop until /exit or end of input."""
        interactive = inp.isatty()
        if interactive:
            try:
                import readline  # noqa: F401 -- line editing and history for input()
            except ImportError:
                pass
            print(HELP, file=out)
        while True:
            try:
                line = input(">>> ") if interactive else _read_line(inp, out)
            except EOFError:
                break
            except KeyboardInterrupt:
                out.write("\n(use /exit or Ctrl-D to quit)\n")
                continue
            if line is None:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit", "/bye"):
                break
            if text == "/clear":
                self.clear()
                out.write("(conversation cleared)\n")
                continue
            if text in ("/help", "/?"):
                out.write(HELP + "\n")
                continue
            try:
                self.answer(text, out)
            except ValueError as e:
                out.write(f"error: {e}\n")


def _read_line(inp: TextIO, out: TextIO) -> str | None:
    out.write(">>> ")
    out.flush()
    line = inp.readline()
    return line if line else None
