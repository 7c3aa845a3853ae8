"""Command line: `mlxserve run` (chat in the terminal), `serve`, `bench`, `convert`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import fields

from mlxserve.config import DTYPES, EngineConfig
from mlxserve.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flag names."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        dest="model_flag",
        default=None,
        help="hub repo id, model directory or .gguf file (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer source, if not the model's")
    g.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="activation dtype (auto: float32 on CPU, the checkpoint's on Metal)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (default: the model's, capped to fit memory)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        "--memory-fraction",
        dest="memory_fraction",
        type=float,
        default=EngineConfig.memory_fraction,
        help="fraction of the memory MLX may use for weights + KV cache",
    )
    g.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step, prefill chunks + decodes (default 2048; `serve` on "
        "the CPU: 32, so a long prompt does not stall the decoding streams)",
    )
    g.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from memory)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--chat-template", default=None, help="a Jinja chat template, or a file holding one"
    )
    g.add_argument("--enforce-eager", action="store_true", help="accepted for vLLM compatibility")


def engine_config(args: argparse.Namespace, model: str | None) -> EngineConfig:
    """EngineConfig from parsed flags (flags not in EngineConfig are ignored)."""
    names = {f.name for f in fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and k != "model"}
    if args.chat_template and os.path.isfile(args.chat_template):
        with open(args.chat_template, encoding="utf-8") as f:
            values["chat_template"] = f.read()
    return EngineConfig(model=model, **values)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
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
    for extra in _extra_commands():
        extra(sub)
    return parser


def _extra_commands() -> list:
    """Sub-commands that live in their own modules."""
    from mlxserve.bench import add_bench_command
    from mlxserve.convert import add_convert_command
    from mlxserve.server.cli import add_serve_command

    return [add_serve_command, add_convert_command, add_bench_command]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", True) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.handler(args) if hasattr(args, "handler") else run_command(args)
    except ValueError as e:  # bad flags, a missing model, a prompt too long: one clear line
        print(f"error: {e}", file=sys.stderr)
        return 2


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
    from mlxserve.chat import ChatSession

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


if __name__ == "__main__":
    sys.exit(main())
