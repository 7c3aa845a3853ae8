"""`mlxserve bench` and each of its sub-commands: flags parsed, one tiny real run each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxserve.cli import bench
from mlxserve.cli.bench import report
from mlxserve.cli.main import build_parser, main
from tests.engine_helpers import make_tiny_model_dir

SUB_COMMANDS = ("latency", "throughput", "serve", "peers", "agents", "long-context", "profile")
TINY_LATENCY = ["--decode-tokens", "2", "--prefill-tokens", "4", "--prompt-tokens", "4"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("bench") / "m")
    return model_dir


def test_bench_help_lists_every_sub_command(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert all(f"\n    {name} " in out for name in SUB_COMMANDS), out


@pytest.mark.parametrize("name", ["latency", "throughput", "serve", "peers"])
def test_each_sub_commands_help_lists_its_options(name: str, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", name, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: mlxserve bench {name} ") and "--out" in out


@pytest.mark.parametrize("name", ["agents", "long-context", "profile"])
def test_the_checkout_sub_commands_show_their_scripts_options(name: str, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", name, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: mlxserve bench {name} ")


def test_profile_runs_the_checkouts_decode_profile(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    argv = ["bench", "profile", str(tiny_model), "--batch", "2", "--steps", "1", "--repeats", "1"]
    argv += ["--verify-rows", "1", "--verify-context", "8", "--overlap-rounds", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["steps"]["2"]["step"] > 0


def test_a_checkout_sub_command_says_where_to_run_it_when_bench_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(bench, "CHECKOUT", tmp_path)  # an install without bench/
    assert main(["bench", "agents", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: `mlxserve bench agents` runs bench/agents of mlxserve's ")
    assert "pip install -e '.[bench]'" in err


def test_bench_without_a_sub_command_takes_model_and_flags_in_any_order() -> None:
    parser = build_parser()
    args = parser.parse_args(["bench", "--decode-tokens", "7", "m.gguf", "--batch-sizes", "2"])
    assert (args.model, args.decode_tokens, args.batch_sizes) == ("m.gguf", 7, [2])
    args = parser.parse_args(["bench", "--json", "x.json"])  # the macOS CI's line: no MODEL
    assert (args.model if hasattr(args, "model") else None, args.json) == (None, "x.json")
    assert parser.parse_args(["bench", "latency", "m"]).bench_command == "latency"
    # A checkout sub-command gets every word after its name, bench's own flags' names too.
    words = ["--out", "x", "--batch", "2", "--json", "y.json"]
    assert parser.parse_args(["bench", "profile", *words]).argv == words


def test_latency_measures_decode_and_prefill_only(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    code = main(["bench", "latency", str(tiny_model), *TINY_LATENCY, "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert set(data["offline"]) == {"decode_tok_s", "prefill_tok_s"}
    assert "profile" not in data and all(v > 0 for v in data["offline"].values())


def test_throughput_measures_the_batches_and_a_profile_when_asked(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["bench", "throughput", str(tiny_model), "--prompt-tokens", "4", "--batch-sizes"]
    argv += ["2", "3", "--batch-tokens", "2", "--profile-batch", "2", "--profile-steps", "1"]
    assert main([*argv, "--out", str(tmp_path / "t")]) == 0
    data = json.loads((tmp_path / "t" / "results.json").read_text())
    assert set(data["offline"]["mlxserve"]) == {"batch2_tok_s", "batch3_tok_s"}
    assert data["profile"]["mlxserve"]["batch"] == 2
    out = capsys.readouterr().out
    assert "| batch 3 output tok/s |" in out and "step profile" in out


def test_serve_refuses_an_unknown_workload_before_starting_anything(capsys) -> None:
    assert main(["bench", "serve", "/nonexistent/model", "--workloads", "serving,nap"]) == 2
    assert capsys.readouterr().err.startswith("error: --workloads: unknown 'nap'")


def test_serve_measures_a_server_on_the_tiny_model(tiny_model: Path, tmp_path: Path) -> None:
    argv = ["bench", "serve", str(tiny_model), "--concurrency", "1", "--requests", "1"]
    assert main([*argv, "--max-tokens", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    level = data["serving"]["mlxserve"]["1"]
    assert level["output_tokens"] == 2 and level["ttft_p50_ms"] > 0
    assert data["rss"]["serving"]["mlxserve"]["peak_mib"] > 0


def test_serve_measures_a_running_server_at_base_url(tiny_model: Path, tmp_path: Path) -> None:
    import sys

    from mlxserve.cli.bench.serving import Server, ServerSpec

    cmd = [sys.executable, "-m", "mlxserve.cli", "serve", str(tiny_model)]
    with Server(ServerSpec("tiny", cmd), tmp_path) as srv:
        argv = ["bench", "serve", str(tiny_model), "--base-url", srv.url, "--concurrency", "2"]
        argv += ["--requests", "2", "--max-tokens", "2", "--out", str(tmp_path / "r")]
        assert main(argv) == 0
        assert srv.proc.poll() is None  # measured, not stopped
    data = json.loads((tmp_path / "r" / "results.json").read_text())
    assert data["serving"][srv.url]["2"]["output_tokens"] == 4
    assert data["rss"]["serving"][srv.url] == {"ready_mib": None, "peak_mib": None}


def test_peers_refuses_an_unknown_peer(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "peers", "--peers", "mlxserve,vllm"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown peer or section 'vllm'")


def test_peers_memory_section_alone(tmp_path: Path) -> None:
    skip = "offline,serving,mixed,busy,prefix"
    argv = ["bench", "peers", "--peers", "mlxserve", "--skip", skip, "--kv-budget-mb", "256"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    memory = json.loads((tmp_path / "results.json").read_text())["memory"]
    # SmolLM2-135M in float32: 30 layers x 3 KV heads x 64 x (K and V) x 4 bytes.
    assert memory["kv_bytes_per_token"] == 30 * 3 * 64 * 2 * 4
    assert (
        memory["distinct"]["mlxserve"] >= memory["distinct"]["mlx_lm"]
        and memory["distinct"]["mlxserve"] > 0
    )


def test_the_report_shows_only_the_sections_that_ran(capsys: pytest.CaptureFixture) -> None:
    results = {
        "model": "m",
        "offline": {"mlxserve": {"decode_tok_s": 10.0, "batch4_tok_s": 30.0}},
        "serving": {"mlxserve": {"2": {"output_tok_s": 5.0, "ttft_p50_ms": 7.0}}},
    }
    report.print_report(results)
    out = capsys.readouterr().out
    assert "| single-stream decode tok/s | 10.0 |" in out and "| batch 4 output tok/s |" in out
    assert "| c=2 output tok/s | 5.0 |" in out and "| c=2 TTFT p50 ms | 7.0 |" in out
    assert "prefill" not in out and "goals" not in out and "mixed" not in out


def test_the_chart_draws_the_panels_it_has_data_for(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    level = {"output_tok_s": 5.0, "ttft_p50_ms": 7.0, "ttft_p99_ms": 9.0}
    level |= {"itl_p50_ms": 1.0, "itl_p99_ms": 2.0}
    results = {"model": "m", "serving": {"mlxserve": {"1": level, "4": level}}}
    assert report.write_chart(results, tmp_path / "serving.png")
    assert (tmp_path / "serving.png").read_bytes()[:4] == b"\x89PNG"
    assert not report.write_chart({"model": "m", "memory": {}}, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
