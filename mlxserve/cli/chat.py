"""`mlxserve run`: the terminal chat (streaming, history, settings) and its flags.

Sampling, from the weakest to the strongest: the chat defaults below (Ollama's), the
model's own (generation_config.json, or a GGUF's general.sampling.*, as vLLM takes them),
the command-line flags, then `/set` in the REPL. An answer also stops when it starts
looping (the same block of tokens over and over, see mlxserve.repetition), which a small
model decoding greedily does until its context is full.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import signal
import sys
from collections.abc import Callable
from typing import TextIO

from mlxserve.cli.engine_args import add_engine_args, engine_config
from mlxserve.cli.vllm_compat import check_quantization
from mlxserve.config import EngineConfig
from mlxserve.engine.llm_engine import LLMEngine
from mlxserve.repetition import LoopDetector
from mlxserve.sampling_params import SamplingParams
from mlxserve.utils import release_free_memory

# Defaults for a chat answer when neither the model nor a flag says otherwise: Ollama's
# sampling (temperature 0.8, top_k 40, top_p 0.9), and a cap on an answer's length.
# repetition_penalty stays 1: here it weighs every token of the conversation, prompt
# included, not Ollama's last 64, and the loop stop below handles degenerate repeats.
# The embedded default model brings its card's temperature 0.2 and top_p 0.9 (as "model"
# defaults, see mlxserve.loader): at 0.8 it drifts off topic, often into French; at 0.2 it
# loops more often (8 of 16 answers of 500 tokens, against 1 of 16 at 0.8), which the loop
# stop cuts.
CHAT_DEFAULTS: dict[str, float | int | None] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "max_tokens": 1024,
}
# What /set may change: SamplingParams fields and how to read their values.
SAMPLING_SETTINGS = (*CHAT_DEFAULTS, "seed")
INT_SETTINGS = ("top_k", "max_tokens", "seed")
NONE_WORDS = ("none", "off", "-")
# Ollama's NAME:TAG model names (llama3.2:1b, hf.co/owner/name:Q4_K_M); "10:30" is no name.
TAGGED_NAME = re.compile(r"^[A-Za-z][\w.-]*(/[\w.-]+)*:[\w.-]+$")


class ChatSession:
    """A conversation with one model; each answer streams as it is generated."""

    _ids = itertools.count()  # request ids, unique among sessions sharing an engine

    def __init__(
        self,
        engine: LLMEngine,
        params: SamplingParams,
        system: str | None = None,
        use_chat_template: bool = True,
        stop_on_loop: bool = True,
        sources: dict[str, str] | None = None,
        is_one_shot: bool = False,
    ) -> None:
        self.engine = engine
        self.params = params
        self.system = system
        self.use_chat_template = use_chat_template and engine.tokenizer.chat_template is not None
        self.stop_on_loop = stop_on_loop
        self.wants_chat_template = use_chat_template
        self.sources = dict(sources or {})  # setting -> where its value came from
        # /load: the engine config to load another model with (set by load()), and how the
        # sampling follows a model's defaults (flags over them; run_command sets it).
        self.config: EngineConfig | None = None
        self.sampling_for: Callable[[dict], tuple[SamplingParams, dict[str, str]]] | None = None
        # One answer, then exit: notes name flags, not REPL commands the user cannot type.
        self.is_one_shot = is_one_shot
        self.messages: list[dict[str, str]] = []
        self.clear()

    @classmethod
    def load(cls, config: EngineConfig, params: SamplingParams, **kw) -> ChatSession:
        print(f"Loading {config.model or 'the default model'} ...", file=sys.stderr, flush=True)
        session = cls(LLMEngine(config), params, **kw)
        session.config = config
        return session

    def load_model(self, model: str) -> str:
        """/load MODEL: go on with another model (the conversation and /set values stay);
        what happened, or ValueError (the current model stays)."""
        if self.config is None:
            raise ValueError("this session cannot load another model")
        if not model:
            raise ValueError("/load needs a model: a hub id, a directory or a .gguf file")
        config = dataclasses.replace(self.config, model=model, served_model_name=None)
        print(f"Loading {model} ...", file=sys.stderr, flush=True)
        engine = LLMEngine(config)
        self.engine, self.config = engine, config
        release_free_memory()  # the last model's weights and pool are garbage now
        self.use_chat_template = (
            self.wants_chat_template and engine.tokenizer.chat_template is not None
        )
        if self.sampling_for is not None:  # the new model's defaults, under flags and /set
            params, sources = self.sampling_for(engine.loaded.generation_defaults)
            kept = {n: getattr(self.params, n) for n, s in self.sources.items() if s == "/set"}
            self.params = dataclasses.replace(params, **kept)
            self.sources = sources | {n: "/set" for n in kept}
        return f"loaded {engine.model_name}"

    def show(self, what: str = "") -> str:
        """/show [info|template|parameters|system|license]: the model and the session."""
        from mlxserve.loader import catalog

        loaded = self.engine.loaded
        what = what or "info"
        if what == "parameters":
            return self.describe_settings()
        if what == "system":
            return self.system or "(no system prompt)"
        if what not in ("info", "template", "license"):
            raise ValueError(
                f"/show {what}: expected info, template, parameters, system or license"
            )
        try:
            details = catalog.details(catalog.describe(loaded.source.path, loaded.source.name))
        except (ValueError, OSError) as e:
            raise ValueError(f"cannot read the model's files: {e}") from None
        if what == "template":
            template = details.chat_template
            if isinstance(template, dict):
                template = "\n".join(f"# template {k!r}\n{v}" for k, v in template.items())
            return template or "(no chat template)"
        if what == "license":
            return details.license or "(no license given)"
        model = details.model
        rows = [
            ("model", self.engine.model_name),
            ("architecture", model.architecture),
            ("parameters", f"{details.parameters:,}"),
            ("quantization", model.quantization),
            ("format", model.format),
            ("context length", str(model.context_length or "-")),
            ("max_model_len", str(self.engine.describe().max_model_len)),
        ]
        return "\n".join(f"  {key:<16} {value}" for key, value in rows)

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _prompt_ids(self) -> list[int]:
        tok = self.engine.tokenizer
        if self.use_chat_template:
            return tok.encode_chat(self.messages, add_generation_prompt=True)
        # Raw completion: the whole transcript as plain text.
        return tok.encode("\n".join(m["content"] for m in self.messages))

    def answer(self, user_text: str, out: TextIO, notes: TextIO | None = None) -> str:
        """Stream the reply to ``user_text`` into ``out``; keeps both in the history.

        Why an answer stopped early (a loop, max_tokens, a full context) is said in
        brackets on ``notes`` (default ``out``). Ctrl-C stops this answer only: the
        partial reply is kept, the session goes on. A looping reply is kept up to the end
        of its first copy of the repeated block, so the next turn does not continue it.
        """
        self.messages.append({"role": "user", "content": user_text})
        rid = f"chat-{next(self._ids)}"
        try:
            self.engine.add_request(rid, None, self.params, prompt_token_ids=self._prompt_ids())
        except ValueError:
            self.messages.pop()
            raise
        detector = LoopDetector() if self.stop_on_loop else None
        parts: list[str] = []
        token_ids: list[int] = []
        note = None
        try:
            while note is None and self.engine.has_unfinished_requests():
                for output in self.engine.step(delta=True):
                    if output.request_id != rid:  # the tail of an earlier, stopped answer
                        continue
                    sample = output.outputs[0]
                    if sample.text:
                        parts.append(sample.text)
                        out.write(sample.text)
                        out.flush()
                    token_ids += sample.token_ids
                    loop = detector.extend(sample.token_ids) if detector else None
                    if loop is not None:
                        self.engine.abort_request(rid)
                        while self.engine.has_unfinished_requests():  # the step in flight
                            self.engine.step()
                        kept = self.engine.tokenizer.decode(token_ids[: loop.keep])
                        parts = [kept]
                        note = self._loop_note()
                        break
                    if sample.finish_reason == "length":
                        note = self._length_note(len(token_ids))
        except KeyboardInterrupt:
            self.engine.abort_request(rid)
            out.write(" [stopped]")
        out.write("\n")
        out.flush()
        if note is not None:
            (notes or out).write(note + "\n")
            (notes or out).flush()
        reply = "".join(parts)
        self.messages.append({"role": "assistant", "content": reply})
        return reply

    def _loop_note(self) -> str:
        if self.is_one_shot:
            return "[stopped: the answer repeats itself; --no-stop-on-loop allows it]"
        return (
            "[stopped: the answer repeats itself; /set stop_on_loop off (or --no-stop-on-loop) "
            "allows it]"
        )

    def _length_note(self, num_tokens: int) -> str:
        cap = self.params.max_tokens
        if cap is not None and num_tokens >= cap:
            if self.is_one_shot:
                return f"[stopped at max_tokens={cap}; --max-tokens N for more]"
            return f"[stopped at max_tokens={cap}; /set max_tokens N (or --max-tokens N) for more]"
        if self.is_one_shot:
            return "[stopped: the context is full]"
        return "[stopped: the context is full; /clear starts a new conversation]"

    # ------------------------------------------------------------- settings
    def set(self, name: str, value: str) -> str:
        """Change one setting from its text (``/set NAME VALUE``); what changed, or ValueError."""
        name = name.replace("-", "_")
        if name == "system":
            self.system = value or None
            rest = [m for m in self.messages if m["role"] != "system"]
            self.messages = ([{"role": "system", "content": value}] if value else []) + rest
            return f"system = {value!r}" if value else "system prompt removed"
        if name == "stop_on_loop":
            if value.lower() not in ("on", "off", "true", "false", "1", "0"):
                raise ValueError(f"stop_on_loop is on or off, got {value!r}")
            self.stop_on_loop = value.lower() in ("on", "true", "1")
            return f"stop_on_loop = {'on' if self.stop_on_loop else 'off'}"
        if name not in SAMPLING_SETTINGS:
            raise ValueError(
                f"unknown setting {name!r}; settable: {', '.join(SAMPLING_SETTINGS)}, "
                "stop_on_loop, system"
            )
        parsed = _parse_value(name, value)
        # replace() re-validates: a bad value raises ValueError and changes nothing.
        self.params = dataclasses.replace(self.params, **{name: parsed})
        self.sources[name] = "/set"
        return f"{name} = {_show(parsed)}"

    def describe_settings(self) -> str:
        """The settings, one per line, each with where its value came from."""
        rows = [
            (name, _show(getattr(self.params, name)), self.sources.get(name))
            for name in SAMPLING_SETTINGS
        ]
        rows.append(("stop_on_loop", "on" if self.stop_on_loop else "off", None))
        rows.append(("system", repr(self.system) if self.system else "none", None))
        return "\n".join(
            f"  {name:<20} {value:<8} ({source})" if source else f"  {name:<20} {value}"
            for name, value, source in rows
        )


def _parse_value(name: str, text: str) -> float | int | None:
    if not text:
        raise ValueError(f"/set {name} needs a value")
    if name in ("max_tokens", "seed") and text.lower() in NONE_WORDS:
        return None
    try:
        return int(text) if name in INT_SETTINGS else float(text)
    except ValueError:
        kind = "an integer" if name in INT_SETTINGS else "a number"
        raise ValueError(f"{name} must be {kind}, got {text!r}") from None


def _show(value: object) -> str:
    return "none" if value is None else str(value)


# ----------------------------------------------------------------- the command line
def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Sampling flags; unset ones (None) leave the model's or the chat defaults."""
    g = parser.add_argument_group(
        "sampling (default: the model's own: its generation_config, GGUF general.sampling.*, "
        "or for the embedded model its card's temperature 0.2, top-p 0.9; else Ollama's: "
        "temperature 0.8, top-k 40, top-p 0.9; at most 1024 tokens an answer)"
    )
    g.add_argument("--temperature", type=float, default=None, help="0: greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None, help="0: no top-k")
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--max-tokens", type=int, default=None, help="tokens per answer")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument(
        "--stop-on-loop",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop an answer that repeats the same text over and over",
    )


def chat_sampling(
    args: argparse.Namespace, model_defaults: dict[str, float | int]
) -> tuple[SamplingParams, dict[str, str]]:
    """SamplingParams from flags over the model's defaults over CHAT_DEFAULTS, and where
    each value came from ("flag", "model", "default")."""
    values: dict[str, float | int | None] = {}
    sources: dict[str, str] = {}
    for name, default in CHAT_DEFAULTS.items():
        flag = getattr(args, name, None)
        if flag is not None:
            values[name], sources[name] = flag, "flag"
        elif name in model_defaults:
            values[name], sources[name] = model_defaults[name], "model"
        else:
            values[name], sources[name] = default, "default"
    # The engine's seed (--seed, default 0) makes sampled answers reproducible.
    seed = EngineConfig.seed if args.seed is None else args.seed
    sources["seed"] = "default" if args.seed is None else "flag"
    if values["temperature"] == 0:
        seed = None  # greedy: nothing to seed
    return SamplingParams(**values, seed=seed, stop=args.stop), sources


def split_model_and_prompt(
    positional: list[str], model_flag: str | None
) -> tuple[str | None, str | None]:
    """`run [MODEL] [PROMPT]`: the first word is a MODEL only if it is one here.

    That is: an existing file or directory, a path (./x, /x, ~/x) or a .gguf name, or a
    hub id (owner/name) already in the local Hugging Face cache. Anything else, `and/or`
    included, is the prompt; a hub model not downloaded yet is named with --model. A first
    word that looks like a model name (owner/name, name:tag) gets a note on stderr saying
    it was read as the prompt.
    """
    from mlxserve.loader.hub import is_cached, is_repo_id

    words = list(positional)
    if model_flag is not None or not words:
        return model_flag, (" ".join(words) if words else None)
    first = words[0]
    looks_like_path = " " not in first and (
        first.endswith(".gguf") or first.startswith(("/", "./", "../", "~"))
    )
    if looks_like_path or os.path.exists(first) or is_cached(first):
        return words.pop(0), (" ".join(words) if words else None)
    if is_repo_id(first):
        print(
            f"note: {first!r} is not a local or downloaded model, so it is read as the prompt; "
            f"to download it from the hub: mlxserve run --model {first}",
            file=sys.stderr,
        )
    elif TAGGED_NAME.match(first):
        print(
            f"note: {first!r} looks like an Ollama model name but is not a local or downloaded "
            "model, so it is read as the prompt; name a model with --model: a hub id "
            "(owner/name), a directory or a .gguf file",
            file=sys.stderr,
        )
    return None, " ".join(words)


def add_run_command(subparsers: argparse._SubParsersAction) -> None:
    """Register `run` on the mlxserve command line."""
    run = subparsers.add_parser(
        "run",
        help="chat with a model in the terminal",
        description="Chat with a model: a streaming REPL, or one answer when "
        "a PROMPT is given or stdin is piped. Options may come before, between or after "
        "MODEL and PROMPT; after -- every word is the prompt's (one starting with - too).",
        intermixed=True,  # main.CommandParser
    )
    run.add_argument(
        "words",
        nargs="*",
        metavar="[MODEL] [PROMPT]",
        help="model (a directory, .gguf, or a downloaded hub id; default: the embedded "
        "SmolLM2) and prompt",
    )
    run.add_argument("--system", default=None, help="system prompt")
    run.add_argument(
        "--no-chat-template",
        action="store_true",
        help="send the prompt as raw text (completion), not as a chat message",
    )
    run.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    add_sampling_args(run)
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
    from mlxserve.cli.repl import Repl

    model, prompt = split_model_and_prompt(args.words, args.model_flag)
    chat_sampling(args, {})  # bad flags fail here, before the model loads
    stdin_text = _piped_input(wait=prompt is None)
    if stdin_text is not None:
        prompt = f"{prompt}\n\n{stdin_text}" if prompt and stdin_text else prompt or stdin_text
    if prompt is not None and not prompt.strip():
        raise ValueError("the prompt is empty")
    session = ChatSession.load(
        engine_config(args, model),
        SamplingParams(),
        system=args.system,
        use_chat_template=not args.no_chat_template,
        stop_on_loop=args.stop_on_loop,
        is_one_shot=prompt is not None,
    )
    loaded = session.engine.loaded
    check_quantization(args, loaded.source.kind, loaded.config)
    session.sampling_for = lambda defaults: chat_sampling(args, defaults)
    session.params, session.sources = chat_sampling(args, loaded.generation_defaults)
    if prompt is not None:
        session.answer(prompt, sys.stdout, notes=sys.stderr)
        return 0
    if sys.stdin.isatty():
        # Ctrl-C must stop an answer even when we were started with SIGINT ignored (as
        # background jobs of a non-interactive shell are): Python then installs no handler.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    Repl(session, sys.stdin, sys.stdout).run()
    return 0
