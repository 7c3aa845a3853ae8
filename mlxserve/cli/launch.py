"""`mlxserve launch AGENT`: a coding agent on a local mlxserve in one command.

Reuses the server already answering on --host/--port, or starts `mlxserve serve` there (and
stops it when the agent exits), then runs the agent with the switches that point it at that
server and keep it there: its base URL, model and key; telemetry, update checks and error
reports off; Claude Code's per-request billing header off (the server also neutralizes it:
docs/agents.md). Nothing in the user's own configuration files is changed: each agent is
told through its environment or its command line, for this run only.

    claude    Anthropic Messages API (/v1/messages), from environment variables
    codex     Responses API (/v1/responses), a model provider given with -c overrides
    aider     Chat Completions (/v1/chat/completions) through litellm, from flags
    opencode  Chat Completions through the AI SDK, from OPENCODE_CONFIG_CONTENT
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from mlxserve.cpu.blas import user_cache_dir

AGENTS = ("claude", "codex", "aider", "opencode")
INSTALL = {
    "claude": "npm install -g @anthropic-ai/claude-code",
    "codex": "npm install -g @openai/codex",
    "aider": "python -m pip install aider-install && aider-install",
    "opencode": "npm install -g opencode-ai",
}
# A CPU or a large model can take minutes on an agent's ~20k-token first prompt; the
# agents' own stream watchdogs would end the request first (docs/agents.md).
SLOW_PREFILL_MS = "1800000"
DEFAULT_KEY = "mlxserve"  # any value works unless the server was started with --api-key
START_TIMEOUT_S = 900.0


@dataclass
class AgentRun:
    """How to run one agent: its argv, the variables set and the ones removed."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    files: dict[Path, str] = field(default_factory=dict)  # written before it starts


def add_launch_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "launch",
        help="run a coding agent (claude, codex, aider, opencode) on a local mlxserve",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        intermixed=True,
    )
    parser.add_argument("agent", choices=AGENTS, help="the agent to run")
    parser.add_argument(
        "--model",
        default=None,
        help="the model a started server serves (default: the embedded one); a running "
        "server is used with the model it serves",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the server's address")
    parser.add_argument("--port", type=int, default=8000, help="the server's port")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="a started server's context length (default: the model's); Claude Code's "
        "prompt alone is ~20k tokens",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="the key of a server started with --api-key (default: $MLXSERVE_API_KEY)",
    )
    parser.add_argument(
        "--print-env",
        action="store_true",
        help="print the agent's command and environment instead of running it (a server "
        "is not started)",
    )
    parser.add_argument(
        "agent_args", nargs="*", metavar="-- ARGS", help="arguments passed on to the agent"
    )
    parser.set_defaults(handler=run_launch)


def agent_run(
    agent: str, url: str, model: str, context: int | None, key: str, cache_dir: Path
) -> AgentRun:
    """The command line and environment that point ``agent`` at the server at ``url``
    serving ``model`` (``context`` tokens long, when known)."""
    if agent == "claude":
        env = {
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_AUTH_TOKEN": key,
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
            "CLAUDE_CODE_SUBAGENT_MODEL": model,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "API_TIMEOUT_MS": SLOW_PREFILL_MS,
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS": SLOW_PREFILL_MS,
        }
        # A key of the real API in the user's environment would make Claude Code ask which
        # to use; the local server needs only the token above.
        return AgentRun(["claude"], env, unset=("ANTHROPIC_API_KEY",))
    if agent == "codex":
        provider = {
            "name": '"mlxserve"',
            "base_url": json.dumps(f"{url}/v1"),
            "wire_api": '"responses"',
            "env_key": '"MLXSERVE_API_KEY"',
            "stream_idle_timeout_ms": SLOW_PREFILL_MS,
        }
        settings = [f"model_providers.mlxserve.{k}={v}" for k, v in provider.items()]
        settings += ['model_provider="mlxserve"', f"model={json.dumps(model)}"]
        settings += ["analytics.enabled=false", "check_for_update_on_startup=false"]
        settings += [f"model_context_window={context}"] if context else []
        argv = ["codex"] + [word for s in settings for word in ("-c", s)]
        return AgentRun(argv, {"MLXSERVE_API_KEY": key})
    if agent == "aider":
        argv = ["aider", "--model", f"openai/{model}", "--openai-api-base", f"{url}/v1"]
        argv += ["--openai-api-key", key, "--no-check-update", "--analytics-disable"]
        argv += ["--no-show-model-warnings"]
        files = {}
        if context:  # else litellm knows nothing of the model's context and says so
            metadata = cache_dir / "aider-model-metadata.json"
            files[metadata] = json.dumps(
                {
                    f"openai/{model}": {
                        "max_input_tokens": context,
                        "input_cost_per_token": 0,
                        "output_cost_per_token": 0,
                        "litellm_provider": "openai",
                        "mode": "chat",
                    }
                },
                indent=2,
            )
            argv += ["--model-metadata-file", str(metadata)]
        return AgentRun(argv, {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}, files=files)
    assert agent == "opencode", agent
    limits = {"limit": {"context": context, "output": min(context, 32768)}} if context else {}
    config = {
        "provider": {
            "mlxserve": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "mlxserve",
                "options": {"baseURL": f"{url}/v1", "apiKey": key},
                "models": {model: {"name": model} | limits},
            }
        },
        "model": f"mlxserve/{model}",
        "autoupdate": False,
        "share": "disabled",
    }
    env = {"OPENCODE_CONFIG_CONTENT": json.dumps(config), "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    return AgentRun(["opencode"], env)


def served_model(url: str, key: str, timeout: float = 2.0) -> tuple[str, int | None] | None:
    """(model name, context length) of the server answering at ``url``; None if none does.
    ValueError if something answers that is not a server we can use."""
    request = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise ValueError(f"the server at {url} wants an API key: give --api-key") from None
        raise ValueError(f"{url}/v1/models answered {e.code}: is it an mlxserve?") from None
    except (urllib.error.URLError, OSError, TimeoutError):
        return None
    except json.JSONDecodeError:
        raise ValueError(f"{url}/v1/models did not answer JSON: is it an mlxserve?") from None
    cards = body.get("data") or []
    if not cards:
        raise ValueError(f"the server at {url} serves no model")
    return cards[0]["id"], cards[0].get("max_model_len")


def start_server(args: argparse.Namespace, url: str, log_path: Path) -> subprocess.Popen:
    """`mlxserve serve` on --host/--port, its output in ``log_path``; waits until it
    answers (ValueError with the log's end if it exits first)."""
    cmd = [sys.executable, "-m", "mlxserve", "serve", "--host", args.host]
    cmd += ["--port", str(args.port), "--disable-log-stats"]
    cmd += [args.model] if args.model else []
    cmd += ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    cmd += ["--api-key", args.api_key] if args.api_key else []
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting: {' '.join(cmd[2:])} (log: {log_path})", file=sys.stderr, flush=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            raise ValueError("the server exited before it answered:\n" + "\n".join(tail))
        if _healthy(url):
            return process
        time.sleep(0.5)
    stop_server(process)
    raise ValueError(f"the server did not answer within {START_TIMEOUT_S:.0f} s (log: {log_path})")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, TimeoutError):
        return False


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()  # SIGTERM: a graceful shutdown, requests in flight end first
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_launch(args: argparse.Namespace) -> int:
    key = args.api_key or os.environ.get("MLXSERVE_API_KEY") or DEFAULT_KEY
    url = f"http://{args.host}:{args.port}"
    cache_dir = _cache_dir()
    agent_args = args.agent_args
    found = served_model(url, key)
    if args.print_env:
        model, context = found or (args.model or "<model>", args.max_model_len)
        run = agent_run(args.agent, url, model, context, key, cache_dir)
        _write_files(run)
        for name in run.unset:
            print(f"unset {name}")
        for name, value in run.env.items():
            print(f"export {name}={shlex.quote(value)}")
        print(" ".join(shlex.quote(word) for word in run.argv + agent_args))
        return 0
    if shutil.which(args.agent) is None:
        raise ValueError(f"{args.agent} is not installed (or not on PATH): {INSTALL[args.agent]}")
    server = None
    if found is None:
        server = start_server(args, url, cache_dir / f"serve-{args.port}.log")
        found = served_model(url, key)
        assert found is not None
    else:
        print(f"using the server at {url} (model {found[0]})", file=sys.stderr)
    run = agent_run(args.agent, url, found[0], found[1], key, cache_dir)
    _write_files(run)
    env = {k: v for k, v in os.environ.items() if k not in run.unset} | run.env
    try:
        return subprocess.run(run.argv + agent_args, env=env).returncode
    except KeyboardInterrupt:
        return 130
    finally:
        if server is not None:
            stop_server(server)


def _write_files(run: AgentRun) -> None:
    for path, text in run.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _cache_dir() -> Path:
    return user_cache_dir() / "launch"
