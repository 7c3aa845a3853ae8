"""The coding-agent clients: installed at bench time into the cache, run headless.

    claude-code  npm @anthropic-ai/claude-code   Anthropic /v1/messages
    codex        npm @openai/codex               OpenAI /v1/responses
    aider        PyPI aider-chat (its own venv)  OpenAI /v1/chat/completions (litellm)
    opencode     npm opencode-ai                 OpenAI /v1/chat/completions (AI SDK)

Each is told about the server only through its documented switches (env vars, a config
file, flags), with its telemetry, update checks and error reporting off, and runs with
HTTP(S)_PROXY pointing at a local door that refuses everything (NO_PROXY=127.0.0.1), so
no byte leaves the machine and any attempt shows up in the results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.agents.servers import SERVED_NAME

NPM_PACKAGES = {
    "claude-code": "@anthropic-ai/claude-code",
    "codex": "@openai/codex",
    "opencode": "opencode-ai",
}
# The npm packages' postinstall scripts only copy the platform binary out of an optional
# dependency (no network); npm 11 skips unapproved install scripts, so the bench runs them.
POSTINSTALL = {
    "claude-code": ("@anthropic-ai/claude-code", "install.cjs"),
    "opencode": ("opencode-ai", "postinstall.mjs"),
}
BINARY = {"claude-code": "claude", "codex": "codex", "opencode": "opencode", "aider": "aider"}
ALL = ("claude-code", "codex", "aider", "opencode")
INSTALL_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Session:
    """What one client run is told: the proxy's URL, the task, and its limits."""

    url: str
    prompt: str
    env: dict[str, str]
    max_turns: int = 8
    max_output_tokens: int = 1024
    context: int = 32768
    resume: bool = False  # a follow-up turn: continue the client's last conversation


@dataclass
class Run:
    """How to run one client once: argv, env and the files it needs first."""

    argv: list[str]
    env: dict[str, str]
    files: dict[Path, str] = field(default_factory=dict)


def install(name: str, root: Path, log=print) -> tuple[Path, str]:
    """Install client ``name`` under ``root`` (once); its executable and version."""
    if name == "aider":
        venv = root / "aider-venv"
        exe = venv / "bin" / "aider"
        if not exe.exists():
            log(f"[agents] installing aider-chat into {venv} (pip)")
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "aider-chat"]
            subprocess.run(pip, check=True, timeout=INSTALL_TIMEOUT_S)
        out = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "show", "aider-chat"],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        version = next(
            (ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Version:")),
            "?",
        )
        return exe, version
    prefix = root / ("npm" if name != "opencode" else "npm-opencode")
    exe = prefix / "node_modules" / ".bin" / BINARY[name]
    package = NPM_PACKAGES[name]
    if not exe.exists():
        log(f"[agents] installing {package} into {prefix} (npm)")
        prefix.mkdir(parents=True, exist_ok=True)
        cmd = ["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", package]
        subprocess.run(cmd, check=True, timeout=INSTALL_TIMEOUT_S)
    if name in POSTINSTALL:
        pkg, script = POSTINSTALL[name]
        pkg_dir = prefix / "node_modules" / pkg
        if _is_placeholder(pkg_dir, name):
            subprocess.run(["node", script], cwd=pkg_dir, check=True, timeout=120)
    manifest = json.loads((prefix / "node_modules" / package / "package.json").read_text())
    return exe, manifest["version"]


def _is_placeholder(pkg_dir: Path, name: str) -> bool:
    """Whether the package's bin is still the stub its postinstall replaces (a few KB)."""
    manifest = json.loads((pkg_dir / "package.json").read_text())
    target = pkg_dir / manifest["bin"][BINARY[name]]
    return not target.exists() or target.stat().st_size < 1_000_000


def base_env(home: Path, catcher_url: str, bin_dirs: list[Path]) -> dict[str, str]:
    """The environment every client runs in: a fresh HOME, and every non-local
    connection sent to the refusing door."""
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "USER", "LOGNAME", "SHELL", "TMPDIR")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env["PATH"] = os.pathsep.join([*map(str, bin_dirs), env.get("PATH", "/usr/bin:/bin")])
    env["HOME"] = str(home)
    env["XDG_CONFIG_HOME"] = str(home / ".config")
    env["XDG_CACHE_HOME"] = str(home / ".cache")
    env["XDG_DATA_HOME"] = str(home / ".local" / "share")
    env["XDG_STATE_HOME"] = str(home / ".local" / "state")
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[var] = env[var.lower()] = catcher_url
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["TERM"] = "dumb"
    env["NO_COLOR"] = "1"
    return env


def claude_code(exe: Path, session: Session) -> Run:
    """`claude -p` with Anthropic's env switches. As root it refuses
    --dangerously-skip-permissions unless IS_SANDBOX=1 says it runs in a sandbox."""
    env = dict(session.env)
    env.update(
        ANTHROPIC_BASE_URL=session.url,
        ANTHROPIC_AUTH_TOKEN="bench",
        ANTHROPIC_MODEL=SERVED_NAME,
        ANTHROPIC_SMALL_FAST_MODEL=SERVED_NAME,
        ANTHROPIC_DEFAULT_HAIKU_MODEL=SERVED_NAME,
        ANTHROPIC_DEFAULT_SONNET_MODEL=SERVED_NAME,
        ANTHROPIC_DEFAULT_OPUS_MODEL=SERVED_NAME,
        CLAUDE_CODE_SUBAGENT_MODEL=SERVED_NAME,
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_BUG_COMMAND="1",
        API_TIMEOUT_MS="1800000",  # a slow CPU prefill of its ~18k-token prompt
        # Its stream watchdog ends a stream 300 s after the last event its SDK passes on
        # (pings are not), even while bytes arrive; this raises it (it cannot be lowered).
        CLAUDE_STREAM_IDLE_TIMEOUT_MS="1800000",
        CLAUDE_CODE_MAX_RETRIES="2",
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(session.max_output_tokens),
        IS_SANDBOX="1",
    )
    argv = [str(exe), "-p", session.prompt, "--output-format", "stream-json", "--verbose"]
    argv += ["--max-turns", str(session.max_turns), "--model", SERVED_NAME]
    argv += ["--dangerously-skip-permissions"] + (["--continue"] if session.resume else [])
    return Run(argv, env)


def codex(exe: Path, session: Session) -> Run:
    """`codex exec` with a custom provider in $CODEX_HOME/config.toml (Responses API)."""
    home = Path(session.env["HOME"]) / ".codex"
    env = dict(session.env, CODEX_HOME=str(home), MLXSERVE_API_KEY="bench")
    config = f"""\
model = "{SERVED_NAME}"
model_provider = "mlxserve"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false
model_context_window = {session.context}

[model_providers.mlxserve]
name = "mlxserve"
base_url = "{session.url}/v1"
wire_api = "responses"
env_key = "MLXSERVE_API_KEY"
request_max_retries = 1
stream_max_retries = 1
stream_idle_timeout_ms = 1800000

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
log_user_prompt = false
"""
    argv = [str(exe), "exec"] + (["resume", "--last"] if session.resume else [])
    argv += ["--json", "--skip-git-repo-check", session.prompt]
    return Run(argv, env, {home / "config.toml": config})


def aider(exe: Path, session: Session) -> Run:
    """aider through litellm's OpenAI provider. Its model-info lookups stay local:
    litellm's cost map from the package, aider's own (fetched from GitHub once a day) seeded
    empty in the fresh HOME, and the model's context told by a metadata file."""
    env = dict(session.env, LITELLM_LOCAL_MODEL_COST_MAP="True", AIDER_ANALYTICS="false")
    env["AIDER_CHECK_UPDATE"] = "false"
    home = Path(env["HOME"])
    metadata = {
        f"openai/{SERVED_NAME}": {
            "max_input_tokens": session.context,
            "max_output_tokens": session.max_output_tokens,
            "input_cost_per_token": 0,
            "output_cost_per_token": 0,
            "litellm_provider": "openai",
            "mode": "chat",
        }
    }
    files = {
        home / ".aider" / "caches" / "model_prices_and_context_window.json": "{}",
        home / ".aider.model.metadata.json": json.dumps(metadata, indent=2),
    }
    argv = [str(exe), "--model", f"openai/{SERVED_NAME}", "--openai-api-base", f"{session.url}/v1"]
    argv += ["--openai-api-key", "bench", "--yes-always", "--no-auto-commits"]
    argv += ["--no-check-update", "--analytics-disable", "--no-show-release-notes"]
    argv += ["--no-gitignore", "--no-show-model-warnings", "--no-pretty", "--no-fancy-input"]
    argv += ["--auto-test", "--test-cmd", "python3 test_calc.py"]
    argv += ["--model-metadata-file", str(home / ".aider.model.metadata.json")]
    argv += ["--max-chat-history-tokens", "4096", "--message", session.prompt, "calc.py"]
    argv += ["--restore-chat-history"] if session.resume else []
    return Run(argv, env, files)


def opencode(exe: Path, session: Session) -> Run:
    """`opencode run` with an OpenAI-compatible provider in its config file."""
    config_path = Path(session.env["HOME"]) / ".config" / "opencode" / "opencode.json"
    config = {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "provider": {
            "mlxserve": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "mlxserve",
                "options": {"baseURL": f"{session.url}/v1", "apiKey": "bench"},
                "models": {
                    SERVED_NAME: {
                        "name": SERVED_NAME,
                        "limit": {"context": session.context, "output": session.max_output_tokens},
                    }
                },
            }
        },
        "model": f"mlxserve/{SERVED_NAME}",
    }
    env = dict(session.env, OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_MODELS_FETCH="1")
    env["OPENCODE_DISABLE_SHARE"] = "1"
    argv = [str(exe), "run", "--print-logs", "--model", f"mlxserve/{SERVED_NAME}"]
    argv += ["--continue"] if session.resume else []
    argv += [session.prompt]
    return Run(argv, env, {config_path: json.dumps(config, indent=2)})


MAKE_RUN = {"claude-code": claude_code, "codex": codex, "aider": aider, "opencode": opencode}
