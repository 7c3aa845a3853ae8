"""Command line: `mlxserve run` (chat in the terminal), `serve`, `launch`, `bench`, `convert`,
`doctor`, and the model commands `pull`, `list`, `show`, `rm`, `ps`.

Each sub-command lives in its own module and registers itself here; they share the
engine flags through :mod:`mlxserve.cli.engine_args` and never import this module.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from mlxserve import __version__
from mlxserve.cli.bench import add_bench_command
from mlxserve.cli.chat import add_run_command
from mlxserve.cli.convert import add_convert_command
from mlxserve.cli.doctor import add_doctor_command
from mlxserve.cli.launch import add_launch_command
from mlxserve.cli.models import add_models_commands
from mlxserve.cli.ps import add_ps_command
from mlxserve.cli.serve import add_serve_command

DESCRIPTION = (
    "Run, serve and benchmark LLMs on MLX: `mlxserve run`, `serve`, `launch`, `convert`, "
    "`bench`, `doctor`; manage models: `pull`, `list`, `show`, `rm`, `ps`."
)
SUB_COMMANDS = (
    add_run_command,
    add_serve_command,
    add_convert_command,
    add_bench_command,
    add_doctor_command,
    add_launch_command,
    add_models_commands,
    add_ps_command,
)


class CommandParser(argparse.ArgumentParser):
    """A sub-command's parser. ``intermixed=True``: options may come anywhere among the
    words (`run ./dir --temperature 0 "hi"`), as argparse's intermixed parsing allows, and
    every word after `--` is one more of the words (the ``nargs="*"`` positional), even a
    word that starts with "-"."""

    def __init__(self, *args: Any, intermixed: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.intermixed = intermixed
        self._is_parsing = False

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if not self.intermixed or self._is_parsing:  # Python < 3.13's intermixed parsing
            return super().parse_known_args(args, namespace)  # calls this method again
        args = list(sys.argv[1:] if args is None else args)
        # Python 3.11's intermixed parsing reads the words after `--` as options in its
        # second pass (`-- -hi` is taken for -h), so they are kept out of argparse's hands.
        cut = args.index("--") if "--" in args else len(args)
        self._is_parsing = True
        try:
            namespace, extras = self.parse_known_intermixed_args(args[:cut], namespace)
        finally:
            self._is_parsing = False
        (words,) = (a for a in self._get_positional_actions() if a.nargs == argparse.ZERO_OR_MORE)
        setattr(namespace, words.dest, [*(getattr(namespace, words.dest) or []), *args[cut + 1 :]])
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxserve", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"mlxserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    for add_command in SUB_COMMANDS:
        add_command(sub)
    return parser


def sub_command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of sub-command ``name`` (its errors show its own usage)."""
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:  # bare `mlxserve`: what it can do
        parser.print_help()
        return 0
    if unknown:  # argparse would blame the top-level parser and show its usage
        sub_command_parser(parser, args.command).error(
            f"unrecognized arguments: {' '.join(unknown)}"
        )
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", True) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.handler(args)
    except ValueError as e:  # bad flags, a missing model, a prompt too long: one clear line
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
