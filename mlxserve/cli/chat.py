"""`mlxserve run`: the terminal chat (streaming, history, commands) and its flags."""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
from typing import TextIO

from mlxserve.cli.engine_args import add_engine_args, engine_config
from mlxserve.config import EngineConfig
from mlxserve.engine.llm_engine import LLMEngine
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


def add_sampling_args(parser: argparse.ArgumentParser, temperature: float) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=temperature)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens per answer (default: up to the context length)",
    )
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        max_tokens=args.max_tokens,
        stop=args.stop,
        seed=args.seed if args.temperature > 0 else None,
    )


def split_model_and_prompt(
    positional: list[str], model_flag: str | None
) -> tuple[str | None, str | None]:
    """`run [MODEL] [PROMPT]`: the first word is a MODEL only if it looks like one."""
    from mlxserve.loader.hub import is_repo_id, split_gguf_ref

    words = list(positional)
    model = model_flag
    if model is None and words:
        first = words[0]
        looks_like_path = " " not in first and (
            first.endswith(".gguf") or first.startswith(("/", "./", "../", "~"))
        )
        if os.path.exists(first) or is_repo_id(first) or split_gguf_ref(first) or looks_like_path:
            model = words.pop(0)
    return model, (" ".join(words) if words else None)


def add_run_command(subparsers: argparse._SubParsersAction) -> None:
    """Register `run` on the mlxserve command line."""
    run = subparsers.add_parser(
        "run",
        help="chat with a model in the terminal",
        description="Chat with a model: a streaming REPL, or one answer when "
        "a PROMPT is given or stdin is piped.",
    )
    run.add_argument(
        "words",
        nargs="*",
        metavar="[MODEL] [PROMPT]",
        help="model (hub id, directory, .gguf; default: embedded SmolLM2) and prompt",
    )
    run.add_argument("--system", default=None, help="system prompt")
    run.add_argument(
        "--no-chat-template",
        action="store_true",
        help="send the prompt as raw text (completion), not as a chat message",
    )
    run.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    add_sampling_args(run, temperature=0.0)
    add_engine_args(run)
    run.set_defaults(handler=run_command)


def _piped_input(wait: bool) -> str | None:
    """Text piped into stdin (None for a terminal). With a PROMPT given, stdin is read
    only if data is already there, so an idle open pipe never blocks the answer."""
    if sys.stdin is None or sys.stdin.isatty():
        return None
    if not wait:
        import select

        if not select.select([sys.stdin], [], [], 0.05)[0]:
            return None
    return sys.stdin.read().strip()  # a file's trailing newline is not part of it


def run_command(args: argparse.Namespace) -> int:
    from mlxserve.cli.chat import ChatSession

    model, prompt = split_model_and_prompt(args.words, args.model_flag)
    params = sampling_params(args)
    stdin_text = _piped_input(wait=prompt is None)
    if stdin_text is not None:
        prompt = f"{prompt}\n\n{stdin_text}" if prompt and stdin_text else prompt or stdin_text
    session = ChatSession.load(
        engine_config(args, model),
        params,
        system=args.system,
        use_chat_template=not args.no_chat_template,
    )
    if prompt is not None:
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        session.answer(prompt, sys.stdout)
        return 0
    if sys.stdin.isatty():
        # Ctrl-C must stop an answer even when we were started with SIGINT ignored (as
        # background jobs of a non-interactive shell are): Python then installs no handler.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    session.repl(sys.stdin, sys.stdout)
    return 0
