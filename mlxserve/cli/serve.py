"""`mlxserve serve [MODEL ...]`: vLLM's flag names, then uvicorn over the app.

The first model loads at start-up; the others (more MODELs, --models-dir, --serve-cached)
load on their first request and unload after --keep-alive (server/serving.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path

from mlxserve.cli.engine_args import add_engine_args, engine_config
from mlxserve.cli.vllm_compat import (
    SERVER_FLAGS,
    add_no_effect_flags,
    check_quantization,
    warn_no_effect,
)
from mlxserve.loader import generation_config
from mlxserve.parsers import REASONING_PARSERS, TOOL_PARSERS

logger = logging.getLogger("mlxserve")

# The API key can come from the environment (vLLM's variable is honoured too).
API_KEY_ENV_VARS = ("MLXSERVE_API_KEY", "VLLM_API_KEY")
DEFAULT_MAX_LOADED_MODELS = 3
DEFAULT_KEEP_ALIVE = "5m"  # Ollama's


def add_serve_command(subparsers: argparse._SubParsersAction) -> None:
    """Register `serve` on the mlxserve command line."""
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (hub id, directory, .gguf; default: the embedded SmolLM2) "
        "over an OpenAI-compatible API: /v1/completions, /v1/chat/completions, "
        "/v1/embeddings, /v1/models, /tokenize, /detokenize, /health, /version, /metrics; "
        "also Anthropic's /v1/messages and Ollama's /api/* (see docs/serving.md). With "
        "several models, a request's `model` picks one; the first loads at start-up, the "
        "others on their first request.",
    )
    p.add_argument("model", nargs="?", default=None, metavar="MODEL")
    p.add_argument(
        "more_models", nargs="*", default=[], metavar="MODEL", help="more models to serve"
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer <key>' on /v1/*, /tokenize and /detokenize "
        f"(repeatable; default: ${API_KEY_ENV_VARS[0]} or ${API_KEY_ENV_VARS[1]})",
    )
    g.add_argument(
        "--served-model-name",
        dest="served_model_names",
        nargs="+",
        default=None,
        help="the model name(s) clients use (default: the model's name); the first one "
        "labels the metrics. With several models: the first model's names",
    )
    g.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        help="CORS origins allowed, as a JSON list or comma-separated (default: CORS off)",
    )
    g.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between stats log lines (default: 10)",
    )
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    g.add_argument(
        "--max-request-body-bytes",
        type=_positive_int,
        default=None,  # the server's default, resolved when serving (no server import here)
        metavar="BYTES",
        help="largest request body accepted; a larger one is a 413 (default: 4194304 = 4 MiB)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=_non_negative_float,
        default=None,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long requests in flight may still run before they are "
        "aborted with an error; a second signal exits at once (default: 5)",
    )
    g = p.add_argument_group("several models (Ollama's habits)")
    g.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="also serve every model in DIR (model directories and .gguf files), by its "
        "path in DIR (a .gguf without its suffix)",
    )
    g.add_argument(
        "--serve-cached",
        action="store_true",
        help="also serve every model in the Hugging Face cache (what `mlxserve list` shows)",
    )
    g.add_argument(
        "--keep-alive",
        default=None,
        metavar="DURATION",
        help="how long a model stays loaded after its last request ('5m', '30s', '1h'; '-1' "
        "for ever, '0' unload at once); a request's Ollama keep_alive overrides it "
        "(default: 5m with several models; one model stays loaded)",
    )
    g.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="MODEL",
        help="a model (by served name) that never unloads (repeatable)",
    )
    g.add_argument(
        "--max-loaded-models",
        type=_positive_int,
        default=DEFAULT_MAX_LOADED_MODELS,
        metavar="N",
        help="the most models loaded at once: loading one more unloads the least recently "
        f"used idle one (default: {DEFAULT_MAX_LOADED_MODELS})",
    )
    g = p.add_argument_group("tools and reasoning (vLLM's flags)")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: tool_choice 'auto' is always on when the "
        "model's tool-call format is known",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="the format the model writes tool calls in (default: read from the chat "
        "template; 'hermes' for templates that do not render tools)",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split <think> reasoning into reasoning_content (default: on when the chat "
        "template mentions </think>)",
    )
    g.add_argument(
        "--prompt-normalization",
        type=_prompt_parts,
        default="all",
        metavar="PART,...|all|none",
        help="agents' volatile prompt parts neutralized so the prefix cache holds their "
        "conversation turn after turn: billing-header, token-markers (default: all; "
        "docs/agents.md)",
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="sampling defaults for fields a request leaves out: 'auto' (default) the "
        "model's generation_config.json (GGUF: general.sampling.*), 'vllm' none (OpenAI's "
        "defaults), or the generation_config.json of directory DIR (as vLLM)",
    )
    g = p.add_argument_group("logging")
    g.add_argument(
        "--log-level",
        default="info",
        choices=["error", "warning", "info", "debug"],
        help="mlxserve's own log (debug: each request's prefix-cache hit and where its "
        "prompt left the cache)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    add_engine_args(p)
    add_no_effect_flags(p, SERVER_FLAGS)
    p.set_defaults(handler=serve_command)


def generation_config_choice(choice: str) -> dict[str, float | int] | None:
    """--generation-config: None for 'auto' (the model's, known once it loads), {} for
    'vllm', or the sampling defaults of directory DIR's generation_config.json."""
    if choice == "auto":
        return None
    if choice == "vllm":
        return {}
    if not (Path(choice) / "generation_config.json").is_file():
        raise ValueError(
            f"--generation-config {choice!r}: expected 'auto', 'vllm' or a directory holding "
            "generation_config.json"
        )
    return generation_config.from_model_dir(Path(choice))


def _prompt_parts(spec: str) -> tuple[str, ...]:
    # Imported here: the server's package brings FastAPI, which only `serve` needs.
    from mlxserve.server.prompt_normalization import parse_parts

    try:
        return parse_parts(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def parse_origins(values: list[str] | None) -> tuple[str, ...]:
    """--allowed-origins values: JSON lists (vLLM's form) or comma-separated origins."""
    out: list[str] = []
    for value in values or ():
        value = value.strip()
        if value.startswith("["):
            try:
                items = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--allowed-origins: not a JSON list: {value!r} ({e})") from None
            if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
                raise ValueError(f"--allowed-origins: expected a list of strings, got {value!r}")
            out += items
        else:
            out += [x.strip() for x in value.split(",") if x.strip()]
    return tuple(out)


def api_keys(args: argparse.Namespace, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """Keys from --api-key, else from the first of API_KEY_ENV_VARS that is set."""
    if args.api_key:
        return tuple(args.api_key)
    environ = os.environ if environ is None else environ
    for var in API_KEY_ENV_VARS:
        if environ.get(var):
            return (environ[var],)
    return ()


def model_name_of(model: str) -> str:
    """The name a model is served under by default, known before it loads (as the loader
    names it: a .gguf file's stem, a directory's name, else the repo id as given)."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.stem
    if path.is_dir():
        return path.name
    return model


def more_models(args: argparse.Namespace) -> list[tuple[str, str, str | None]]:
    """(name, what to load, its Hugging Face cache name or None) of every model besides the
    first: the other MODELs, then --models-dir's, then the cache's with --serve-cached."""
    from mlxserve.loader import catalog

    out = [(model_name_of(m), m, None) for m in args.more_models]
    if args.models_dir is not None:
        if not args.models_dir.is_dir():
            raise ValueError(f"--models-dir {str(args.models_dir)!r} is not a directory")
        out += [(name, str(path), None) for name, path in catalog.models_in_dir(args.models_dir)]
    if args.serve_cached:
        out += [(m.name, str(m.path), m.name) for m in catalog.list_models()]
    return out


def serve_command(args: argparse.Namespace) -> int:
    """Load the engine, start its thread, serve the app until a signal, then exit the process."""
    import uvicorn

    logging.getLogger("mlxserve").setLevel(args.log_level.upper())

    from mlxserve.engine.llm_engine import LLMEngine
    from mlxserve.engine.startup import default_max_num_batched_tokens
    from mlxserve.loader import DEFAULT_MODEL_NAME
    from mlxserve.server.app import ServerConfig, build_app
    from mlxserve.server.body import DEFAULT_MAX_REQUEST_BODY_BYTES
    from mlxserve.server.keep_alive import parse_keep_alive
    from mlxserve.server.metrics import ServerMetrics
    from mlxserve.server.model_loading import serve_engine, start_engine
    from mlxserve.server.served_model import ModelSpec
    from mlxserve.server.serving import ModelPolicy, Serving
    from mlxserve.server.shutdown import DEFAULT_SHUTDOWN_TIMEOUT, GracefulServer, bind_socket
    from mlxserve.worker.launch import launched_rank

    if args.model and args.model_flag and args.model != args.model_flag:
        raise ValueError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
    model = args.model or args.model_flag
    names = tuple(args.served_model_names or ())
    keys = api_keys(args)
    origins = parse_origins(args.allowed_origins)
    warn_no_effect(args, SERVER_FLAGS)
    defaults = generation_config_choice(args.generation_config)
    config = engine_config(args, model, disk_default=True)
    if config.max_num_batched_tokens is None:  # a server favours smooth streams
        config = dataclasses.replace(
            config, max_num_batched_tokens=default_max_num_batched_tokens(serving=True)
        )
    others = more_models(args)
    if (others or args.keep_alive is not None) and config.world_size > 1:
        raise ValueError(
            "several models, and --keep-alive, are for one machine: a tensor or pipeline "
            "parallel model stays loaded for the server's life"
        )
    several = bool(others or args.models_dir or args.serve_cached)
    first_names = set(names) or {model_name_of(model) if model else DEFAULT_MODEL_NAME}
    unknown = [n for n in args.pin if n not in first_names | {name for name, _, _ in others}]
    if unknown:  # before anything loads
        raise ValueError(f"--pin {unknown[0]!r}: no model is served under that name")
    keep_alive = parse_keep_alive(args.keep_alive or DEFAULT_KEEP_ALIVE, "--keep-alive")
    policy = ModelPolicy(
        unloads=several or args.keep_alive is not None,
        keep_alive=keep_alive,
        pinned=frozenset(args.pin),
        max_loaded_models=args.max_loaded_models,
    )
    first_config = dataclasses.replace(config, served_model_name=names[0]) if names else config
    if config.world_size > 1 and launched_rank() not in (None, 0):
        # Started by mlx.launch on every rank: the others only run rank 0's forwards
        # (LLMEngine exits the process when rank 0 stops); rank 0 serves HTTP.
        LLMEngine(first_config)
    # Bind first: a port in use is an error now, not after the model has loaded.
    sock = bind_socket(args.host, args.port)
    logger.info("loading %s ...", model or "the default model")
    chat = {
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
        "prompt_normalization": args.prompt_normalization,
    }
    first = ModelSpec(names, first_config, sampling_defaults=defaults, **chat)
    try:
        engine = start_engine(first)
        check_quantization(args, engine.loaded.source.kind, engine.loaded.config)
    except BaseException:
        sock.close()
        raise
    names = names or (engine.model_name,)
    first = dataclasses.replace(first, names=names, root=engine.loaded.source.name)
    metrics = ServerMetrics(
        names[0],
        prefix_caching_off=engine.prefix_caching_off,
        speculative=engine.speculative_config is not None,
    )
    server: GracefulServer | None = None

    def engine_dead(reason: str) -> None:  # engine thread: a tensor-parallel rank is gone
        if server is not None:
            server.in_flight.start_draining()
            server.should_exit = True

    served = serve_engine(engine, first, on_step=metrics.on_step, on_dead=engine_dead)
    specs = [first]
    taken = set(names)
    other_defaults = {} if defaults == {} else None  # 'vllm' for all; a DIR: the first only

    def make_spec(name: str, what: str, cache_name: str | None) -> ModelSpec:
        """How the server serves a model besides the first (one given, found or pulled)."""
        other = dataclasses.replace(config, model=what, served_model_name=None)
        return ModelSpec((name,), other, cache_name, other_defaults, cache_name=cache_name, **chat)

    for name, what, cache_name in others:
        if name in taken:
            logger.warning("not serving %s as %r: the name is taken", what, name)
            continue
        taken.add(name)
        specs.append(make_spec(name, what, cache_name))

    def load(spec: ModelSpec):  # worker thread: a request asked for a model not loaded
        engine = start_engine(spec)
        speculative = engine.speculative_config is not None
        model_metrics = metrics.for_model(spec.names[0], engine.prefix_caching_off, speculative)
        return serve_engine(engine, spec, on_step=model_metrics.on_step)

    serving = Serving([served], specs, load, policy, make_spec if several else None)
    llm = served.llm
    server_config = ServerConfig(
        model_names=names,
        api_keys=keys,
        allowed_origins=origins,
        log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
        model_root=engine.loaded.source.name,  # as given (a repo id) or a file's name, no path
        max_request_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        prompt_normalization=args.prompt_normalization,
        sampling_defaults=served.sampling_defaults,
    )
    if server_config.sampling_defaults:
        logger.info(
            "default sampling from the model's generation config (requests override): %s",
            ", ".join(f"{k}={v}" for k, v in sorted(server_config.sampling_defaults.items())),
        )
    app = build_app(None, metrics, server_config, serving)
    logger.info(
        "serving %s on http://%s:%d/v1 (API key %s)",
        ", ".join(names),
        args.host,
        args.port,
        "required" if keys else "not required",
    )
    if len(specs) > 1:
        logger.info(
            "and %d more models, loaded on their first request (at most %d loaded; "
            "keep-alive %s): %s",
            len(specs) - 1,
            policy.max_loaded_models,
            args.keep_alive or DEFAULT_KEEP_ALIVE,
            ", ".join(s.names[0] for s in specs[1:]),
        )
    logger.info("chat page: http://%s:%d/ (API docs: /docs)", args.host, args.port)
    uvicorn_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level
    )
    timeout = DEFAULT_SHUTDOWN_TIMEOUT if args.shutdown_timeout is None else args.shutdown_timeout
    server = GracefulServer(uvicorn_config, app.state.in_flight, timeout)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        serving.shutdown()
    if llm.dead_reason is not None:
        logger.error("exiting: %s", llm.dead_reason)
        return 1
