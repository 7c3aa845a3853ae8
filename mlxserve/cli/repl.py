"""The `mlxserve run` REPL: reading messages (\"\"\" for several lines) and the /commands.

Works the same on a terminal (line editing with readline) and on a pipe, so tests can
drive it either way. A line that starts with "/" is a command and never reaches the model
(an unknown one gets a hint); start the line with a space to send such text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TextIO


class ChatSession(Protocol):
    """What the REPL drives: a conversation (cli/chat.ChatSession) it only talks to."""

    def answer(self, user_text: str, out: TextIO) -> str: ...

    def clear(self) -> None: ...

    def describe_settings(self) -> str: ...

    def set(self, name: str, value: str) -> str: ...

    def load_model(self, model: str) -> str: ...

    def show(self, what: str) -> str: ...


MULTILINE = '"""'
WELCOME = 'Send a message (/help for commands, """ for several lines, Ctrl-D to quit).'
HELP = """\
Commands:
  /set                  show the settings (sampling and session)
  /set NAME VALUE       change one: temperature, top_p, top_k, min_p, repetition_penalty,
                        presence_penalty, frequency_penalty, seed, max_tokens (none: up
                        to the context), stop_on_loop (on/off), system (rest of the line)
  /clear                forget the conversation
  /load MODEL           go on with another model (hub id, directory, .gguf)
  /show [WHAT]          the model: info (default), template, parameters, system, license
  /help                 this help
  /exit                 quit (also /bye, or Ctrl-D)
\"\"\" starts a message of several lines and \"\"\" ends it. Ctrl-C stops an answer.
A line starting with / is a command: start it with a space to send it to the model."""
EXIT_COMMANDS = ("/exit", "/quit", "/bye")


class Repl:
    """Read-answer loop over ``inp``/``out`` until /exit or end of input."""

    def __init__(self, session: ChatSession, inp: TextIO, out: TextIO) -> None:
        self.session = session
        self.inp = inp
        self.out = out
        self.interactive = inp.isatty()

    def run(self) -> None:
        """Until /exit or end of input (Ctrl-D), which ends with a newline for the shell."""
        if self.interactive:
            try:
                import readline  # noqa: F401 -- line editing and history for input()
            except ImportError:
                pass
            self.say(WELCOME)
        while True:
            try:
                message = self.read_message()
            except KeyboardInterrupt:
                self.say("\n(use /exit or Ctrl-D to quit)")
                continue
            if message is None:
                self.out.write("\n")  # the shell prompt starts on its own line
                self.out.flush()
                return
            if not message.strip():
                continue
            if message.startswith("/"):
                if self.command(message.strip()):
                    return
                continue
            try:
                self.session.answer(message.strip(), self.out)
            except ValueError as e:
                self.say(f"error: {e}")

    # ---------------------------------------------------------------- input
    def read_line(self, prompt: str) -> str | None:
        """One line without its newline; None at end of input."""
        if self.interactive:
            try:
                return input(prompt)
            except EOFError:
                return None
        self.out.write(prompt)
        self.out.flush()
        line = self.inp.readline()
        return line.rstrip("\n") if line else None

    def read_message(self) -> str | None:
        """A line, or the lines between \"\"\" and \"\"\" joined; None at end of input."""
        line = self.read_line(">>> ")
        if line is None or not line.startswith(MULTILINE):
            return line
        first = line[len(MULTILINE) :]
        if first.rstrip().endswith(MULTILINE):  # """all on one line"""
            return first.rstrip()[: -len(MULTILINE)]
        lines = [first] if first.strip() else []
        while True:
            more = self.read_line("... ")
            if more is None:  # end of input inside the block: send what there is
                break
            if more.rstrip().endswith(MULTILINE):
                lines.append(more.rstrip()[: -len(MULTILINE)])
                break
            lines.append(more)
        text = "\n".join(lines).strip("\n")
        # A block is a message even if it starts with "/": the leading space says so.
        return " " + text if text.startswith("/") else text

    # ------------------------------------------------------------- commands
    def command(self, text: str) -> bool:
        """Run a /command; True when it ends the REPL."""
        name, _, rest = text.partition(" ")
        handlers: dict[str, Callable[[str], None]] = {
            "/clear": lambda _: self._clear(),
            "/help": lambda _: self.say(HELP),
            "/?": lambda _: self.say(HELP),
            "/set": self._set,
            "/load": lambda rest: self._try(self.session.load_model, rest),
            "/show": lambda rest: self._try(self.session.show, rest),
        }
        if name in EXIT_COMMANDS:
            return True
        handler = handlers.get(name)
        if handler is None:
            self.say(
                f"unknown command {name!r}: /help lists the commands (start the line with "
                "a space to send it to the model)"
            )
        else:
            handler(rest.strip())
        return False

    def _clear(self) -> None:
        self.session.clear()
        self.say("(conversation cleared)")

    def _try(self, command: Callable[[str], str], args: str) -> None:
        try:
            self.say(command(args))
        except ValueError as e:
            self.say(f"error: {e}")

    def _set(self, args: str) -> None:
        if not args:
            self.say(self.session.describe_settings())
            return
        if args.startswith("parameter "):  # Ollama's spelling: /set parameter NAME VALUE
            args = args[len("parameter ") :].strip()
        name, _, value = args.partition(" ")
        try:
            self.say(self.session.set(name, value.strip()))
        except ValueError as e:
            self.say(f"error: {e}")

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()
