"""`mlxserve serve` flags: vLLM's names reach EngineConfig and the server settings."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from mlxserve.cli.engine_args import engine_config
from mlxserve.cli.main import build_parser
from mlxserve.cli.serve import api_keys, parse_origins, serve_command
from mlxserve.server.app import ServerConfig
from tests.paths import ROOT


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_bind_localhost_8000_without_key_or_cors() -> None:
    args = parse()
    assert (args.host, args.port, args.model, args.model_flag) == ("127.0.0.1", 8000, None, None)
    assert api_keys(args, environ={}) == ()
    assert parse_origins(args.allowed_origins) == ()
    assert args.handler is serve_command


def test_vllm_engine_flags_reach_the_engine_config(tmp_path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    args = parse(
        "some/model",
        "--host=0.0.0.0",
        "--port=9001",
        "--max-model-len=2048",
        "--gpu-memory-utilization=0.3",
        "--max-num-seqs=8",
        "--max-num-batched-tokens=512",
        "--block-size=32",
        "--no-enable-prefix-caching",
        "--dtype=float16",
        "--seed=7",
        f"--chat-template={template}",
        "--enforce-eager",
        "--served-model-name",
        "a",
        "b",
    )
    config = engine_config(args, args.model)
    assert config.model == "some/model"
    assert (config.max_model_len, config.memory_fraction) == (2048, 0.3)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.block_size) == (8, 512, 32)
    assert (config.enable_prefix_caching, config.dtype, config.seed) == (False, "float16", 7)
    assert config.chat_template == "{{ messages[0]['content'] }}"
    assert config.enforce_eager
    assert (args.host, args.port, args.served_model_names) == ("0.0.0.0", 9001, ["a", "b"])
    assert parse("--enable-prefix-caching").enable_prefix_caching


@pytest.mark.parametrize("name", ["half", "float"])
def test_vllm_dtype_aliases_are_accepted(name: str) -> None:
    from mlxserve.loader import resolve_dtype

    config = engine_config(parse(f"--dtype={name}"), None)
    assert config.dtype == name
    assert resolve_dtype(config.dtype, {}).size == {"half": 2, "float": 4}[name]


def test_api_key_from_flag_or_environment() -> None:
    assert api_keys(parse("--api-key", "k1", "--api-key", "k2"), environ={}) == ("k1", "k2")
    env = {"MLXSERVE_API_KEY": "from-env", "VLLM_API_KEY": "vllm"}
    assert api_keys(parse(), environ=env) == ("from-env",)
    assert api_keys(parse(), environ={"VLLM_API_KEY": "vllm"}) == ("vllm",)
    assert api_keys(parse("--api-key", "flag"), environ=env) == ("flag",)
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(model_names=("m",), api_keys=("",))


def test_allowed_origins_as_json_list_or_comma_separated() -> None:
    args = parse("--allowed-origins", json.dumps(["https://a.example", "https://b.example"]))
    assert parse_origins(args.allowed_origins) == ("https://a.example", "https://b.example")
    args = parse("--allowed-origins", "https://a.example, https://c.example")
    assert parse_origins(args.allowed_origins) == ("https://a.example", "https://c.example")
    with pytest.raises(ValueError, match="allowed-origins"):
        parse_origins(['["unterminated'])
    with pytest.raises(ValueError, match="allowed-origins"):
        parse_origins(["[1, 2]"])


def test_two_different_models_are_an_error() -> None:
    with pytest.raises(ValueError, match="two models"):
        serve_command(parse("a/b", "--model", "c/d"))


def test_a_port_in_use_fails_before_the_model_loads(tmp_path) -> None:
    """The port is bound first: a missing model is never even looked at (issue 11)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        missing = str(tmp_path / "no-such-model")
        cmd = [sys.executable, "-m", "mlxserve.cli", "serve", missing, "--port", str(port)]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == [f"error: cannot listen on 127.0.0.1:{port}: the address is already in use"]


def test_server_flags_default_to_the_server_limits() -> None:
    from mlxserve.server.body import DEFAULT_MAX_REQUEST_BODY_BYTES
    from mlxserve.server.shutdown import DEFAULT_SHUTDOWN_TIMEOUT

    args = parse()
    assert (args.max_request_body_bytes, args.shutdown_timeout) == (None, None)  # = defaults
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    help_text = " ".join(serve.format_help().split())  # argparse wraps to the terminal width
    assert f"(default: {DEFAULT_MAX_REQUEST_BODY_BYTES} = 4 MiB)" in help_text
    assert f"(default: {DEFAULT_SHUTDOWN_TIMEOUT:g})" in help_text
    args = parse("--max-request-body-bytes", "1024", "--shutdown-timeout", "0")
    assert (args.max_request_body_bytes, args.shutdown_timeout) == (1024, 0.0)
    for bad in ("--max-request-body-bytes=0", "--shutdown-timeout=-1", "--shutdown-timeout=nan"):
        with pytest.raises(SystemExit):
            parse(bad)
