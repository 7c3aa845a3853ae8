"""`mlxserve launch AGENT`: what each agent is told, and a run end to end.

The agents' own settings are checked with the parsers the agents use (TOML for Codex's -c
overrides, JSON for opencode's config); the end-to-end runs put a stand-in agent named
`claude` on PATH that does what Claude Code does with its environment (a Messages request
to ANTHROPIC_BASE_URL with ANTHROPIC_AUTH_TOKEN and ANTHROPIC_MODEL) and records it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlxserve.cli.launch import agent_run
from tests.engine_helpers import make_tiny_model_dir
from tests.paths import ROOT
from tests.server_harness import free_port, start_server

URL = "http://127.0.0.1:8123"


def test_claude_is_pointed_at_the_server_with_its_cache_busting_header_off(tmp_path) -> None:
    run = agent_run("claude", URL, "local", 32768, "k", tmp_path)
    assert run.argv == ["claude"] and "ANTHROPIC_API_KEY" in run.unset
    env = run.env
    assert (env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_AUTH_TOKEN"]) == (URL, "k")
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_SMALL_FAST_MODEL"] == "local"
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"


def test_codex_gets_a_responses_provider_through_toml_overrides(tmp_path) -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    run = agent_run("codex", URL, "local", 32768, "k", tmp_path)
    words = run.argv[1:]
    assert run.argv[0] == "codex" and words[::2] == ["-c"] * (len(words) // 2)
    # Codex reads each -c KEY=VALUE as a TOML assignment with a dotted key.
    config = tomllib.loads("\n".join(words[1::2]))
    assert config["model"] == "local" and config["model_provider"] == "mlxserve"
    provider = config["model_providers"]["mlxserve"]
    assert provider["base_url"] == URL + "/v1" and provider["wire_api"] == "responses"
    assert run.env[provider["env_key"]] == "k"
    assert config["model_context_window"] == 32768 and config["analytics"]["enabled"] is False


def test_aider_and_opencode_use_chat_completions_with_the_models_context(tmp_path) -> None:
    aider = agent_run("aider", URL, "local", 8192, "k", tmp_path)
    flags = dict(zip(aider.argv[1::2], aider.argv[2::2], strict=False))
    assert flags["--model"] == "openai/local" and flags["--openai-api-base"] == URL + "/v1"
    (metadata,) = aider.files.values()
    assert json.loads(metadata)["openai/local"]["max_input_tokens"] == 8192
    opencode = agent_run("opencode", URL, "local", 8192, "k", tmp_path)
    config = json.loads(opencode.env["OPENCODE_CONFIG_CONTENT"])
    provider = config["provider"]["mlxserve"]
    assert provider["options"] == {"baseURL": URL + "/v1", "apiKey": "k"}
    assert provider["models"]["local"]["limit"]["context"] == 8192
    assert config["model"] == "mlxserve/local"


STAND_IN = """#!{python}
import json, os, sys, urllib.request
body = {{"model": os.environ["ANTHROPIC_MODEL"], "max_tokens": 2,
         "messages": [{{"role": "user", "content": "Hi"}}]}}
request = urllib.request.Request(
    os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages", json.dumps(body).encode(),
    {{"Authorization": "Bearer " + os.environ["ANTHROPIC_AUTH_TOKEN"],
      "content-type": "application/json"}})
with urllib.request.urlopen(request, timeout=120) as response:
    reply = json.loads(response.read())
record = {{"args": sys.argv[1:], "reply": reply,
          "api_key_set": "ANTHROPIC_API_KEY" in os.environ}}
open(os.environ["RECORD"], "w").write(json.dumps(record))
sys.exit(3)
"""


def launch(tmp_path: Path, *words: str) -> tuple[subprocess.CompletedProcess, dict]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    agent = bin_dir / "claude"
    agent.write_text(STAND_IN.format(python=sys.executable))
    agent.chmod(0o755)
    record = tmp_path / "record.json"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", RECORD=str(record))
    env["ANTHROPIC_API_KEY"] = "a-real-key"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MLXSERVE_API_KEY", None)
    cmd = [sys.executable, "-m", "mlxserve", "launch", "claude", *words, "--", "--resume"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    return done, json.loads(record.read_text()) if record.exists() else {}


def test_launch_starts_a_server_runs_the_agent_on_it_and_stops_it(tmp_path) -> None:
    port = free_port()
    done, record = launch(tmp_path, "--port", str(port), "--max-model-len", "256")
    assert record, done.stderr
    assert done.returncode == 3  # the agent's own exit status
    assert record["args"] == ["--resume"] and not record["api_key_set"]
    assert record["reply"]["type"] == "message" and record["reply"]["usage"]["output_tokens"] > 0
    assert "starting: mlxserve serve" in done.stderr
    log = Path(done.stderr.split("(log: ", 1)[1].split(")", 1)[0])
    assert log.name == f"serve-{port}.log" and "Application startup complete" in log.read_text()
    with pytest.raises(httpx.ConnectError):  # the server it started is gone with the agent
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_launch_reuses_a_running_server_and_leaves_it_running(tmp_path) -> None:
    _, model_dir = make_tiny_model_dir(tmp_path / "tiny", seed=3)
    args = [str(model_dir), "--served-model-name", "tiny", "--dtype", "float32"]
    server = start_server(args + ["--api-key", "secret"], tmp_path / "server.log")
    try:
        port = server.url.rsplit(":", 1)[1]
        done, _ = launch(tmp_path, "--port", port)
        assert done.returncode == 2 and "wants an API key: give --api-key" in done.stderr
        done, record = launch(tmp_path, "--port", port, "--api-key", "secret")
        assert done.returncode == 3, done.stderr
        assert record["reply"]["model"] == "tiny" and "using the server at" in done.stderr
        assert httpx.get(server.url + "/health", timeout=2).status_code == 200
    finally:
        server.stop()


def test_a_missing_agent_names_how_to_install_it(tmp_path) -> None:
    env = dict(os.environ, PATH=os.path.dirname(sys.executable))
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "mlxserve", "launch", "codex", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "codex is not installed" in done.stderr and "npm install -g @openai/codex" in done.stderr
