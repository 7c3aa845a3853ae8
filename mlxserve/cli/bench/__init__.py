"""`mlxserve bench`: how fast mlxserve is, alone and beside its peers, on one workload.

    mlxserve bench [MODEL]              the quick check: latency, throughput, a step profile
    mlxserve bench latency [MODEL]      single-stream decode and prefill tok/s
    mlxserve bench throughput [MODEL]   N prompts at once: output tok/s (+ a step profile)
    mlxserve bench serve [MODEL]        clients streaming from `mlxserve serve`: TTFT, ITL,
                                        tok/s by concurrency; decoding under arriving prompts;
                                        a shared prefix
    mlxserve bench peers [MODEL.gguf]   all of it beside mlx-lm and llama.cpp, same weights
    mlxserve bench agents               real coding-agent CLIs against mlxserve, llama-server
    mlxserve bench long-context         prefill and decode deep in a context, vs llama-bench -d
    mlxserve bench profile [MODEL]      one decode step taken apart: host vs MLX, per op

Every sub-command sends the same prompts (workload.py). latency, throughput, serve, peers
and the quick check print one report (report.py: tables, goal ratios) and with --out write
results.json and chart.png. agents, long-context and profile run bench/ of a source
checkout (they drive other programs, or reach into the engine's internals).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from mlxserve.cli.bench.offline import (
    LATENCY_FLAGS,
    QUICK_FLAGS,
    THROUGHPUT_FLAGS,
    add_offline_flags,
    offline_command,
)
from mlxserve.cli.bench.serve import add_serve_arguments, serve_command
from mlxserve.cli.bench.suite import add_peers_arguments, peers_command

# The sub-commands that run a script of the checkout's bench/ package, with its own flags:
# name -> (module, one line of help).
CHECKOUT_COMMANDS = {
    "agents": (
        "agents.__main__",
        "real coding-agent CLIs against mlxserve and llama-server (docs/agents.md)",
    ),
    "long-context": (
        "long_context",
        "prefill and decode deep in a long context, beside llama-bench -d (issue 31)",
    ),
    "profile": ("decode_profile", "one decode step taken apart: host vs MLX, compute per op"),
}
# bench/ sits beside the mlxserve package in a checkout (also one installed with -e).
CHECKOUT = Path(__file__).resolve().parents[3]


class SubCommands(argparse._SubParsersAction):
    """`bench`'s sub-commands, where a first word that names none is MODEL: `mlxserve bench
    MODEL --flags` runs the quick check (the line the docs and the macOS CI use)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.quick = argparse.ArgumentParser(prog="mlxserve bench", add_help=False)
        add_offline_flags(self.quick, QUICK_FLAGS, model=True)
        # No choices to check against: any first word is valid, a name or a MODEL (the
        # names live on in _name_parser_map; help lists them from their parsers).
        self.choices = None

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Sequence[Any],
        option_string: str | None = None,
    ) -> None:
        name, rest = values[0], list(values[1:])
        if name in CHECKOUT_COMMANDS:  # its own parser reads the rest, --help included
            namespace.handler, namespace.argv = checkout_command(name), rest
            return
        if name in self._name_parser_map:
            # `bench`'s own flags are the quick check's: a sub-command has only its own.
            for action in self.quick._actions:
                if hasattr(namespace, action.dest):
                    delattr(namespace, action.dest)
            return super().__call__(parser, namespace, values, option_string)
        # Into the same namespace: flags given before MODEL are kept, not reset to defaults.
        _, extras = self.quick.parse_known_args(list(values), namespace)
        if extras:
            vars(namespace).setdefault(argparse._UNRECOGNIZED_ARGS_ATTR, []).extend(extras)


def checkout_command(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        main = checkout_module(name).main
        return main(args.argv) or 0

    return run


def checkout_module(name: str) -> ModuleType:
    """The checkout's ``bench.<module>`` behind sub-command ``name``; a ValueError saying
    where to run it when this mlxserve was installed without its repository."""
    module = CHECKOUT_COMMANDS[name][0]
    if not (CHECKOUT / "bench" / module.replace(".", "/")).with_suffix(".py").exists():
        raise ValueError(
            f"`mlxserve bench {name}` runs bench/{module.split('.')[0]} of mlxserve's source "
            f"checkout, and this mlxserve ({CHECKOUT / 'mlxserve'}) was installed without it: "
            "clone the repository, `pip install -e '.[bench]'` there and run it again"
        )
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    return importlib.import_module(f"bench.{module}")


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench` and its sub-commands on the mlxserve command line."""
    p = subparsers.add_parser(
        "bench",
        help="how fast mlxserve is: latency, throughput, serve, peers, agents, ...",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # argparse reads every word after `bench` against these flags first, also those of
        # a sub-command: `profile --batch` must not be taken for an abbreviated --batch-sizes.
        allow_abbrev=False,
    )
    add_offline_flags(p, QUICK_FLAGS, model=False)  # `mlxserve bench --flags`: the quick check
    quick = ("latency", "throughput")
    p.set_defaults(handler=lambda args: offline_command(args, quick, QUICK_FLAGS))
    p.register("action", "bench_commands", SubCommands)
    sub = p.add_subparsers(
        action="bench_commands", dest="bench_command", metavar="[COMMAND | MODEL]"
    )
    for name, flags, parts, text in (
        ("latency", LATENCY_FLAGS, ("latency",), "single-stream decode and prefill tok/s"),
        ("throughput", THROUGHPUT_FLAGS, ("throughput",), "N prompts at once: output tok/s"),
    ):
        q = sub.add_parser(name, help=text, description=text)
        add_offline_flags(q, flags, model=True)
        q.set_defaults(handler=lambda args, p=parts, f=flags: offline_command(args, p, f))
    q = sub.add_parser(
        "serve",
        help="clients streaming from `mlxserve serve`",
        description=importlib.import_module("mlxserve.cli.bench.serve").__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(q)
    q.set_defaults(handler=serve_command)
    q = sub.add_parser(
        "peers",
        help="mlxserve beside mlx-lm and llama.cpp, same weights, one run",
        description=importlib.import_module("mlxserve.cli.bench.suite").__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_peers_arguments(q)
    q.set_defaults(handler=peers_command)
    for name, (_, text) in CHECKOUT_COMMANDS.items():
        sub.add_parser(name, help=text + "; its flags: --help", add_help=False)
