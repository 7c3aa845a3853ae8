"""The bench harness runs end to end (tiny model), and its memory arithmetic is right."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.cli.bench import memory
from mlxserve.cli.main import main
from mlxserve.cpu import blas
from tests.engine_helpers import make_tiny_model_dir, write_tokenizer


def test_mlxserve_bench_runs_on_the_tiny_model(tmp_path: Path, capsys) -> None:
    _, model_dir = make_tiny_model_dir(tmp_path / "m")
    out = tmp_path / "bench.json"
    code = main(
        ["bench", str(model_dir), "--decode-tokens", "4", "--prefill-tokens", "16",
         "--prompt-tokens", "8", "--batch-sizes", "2", "3", "--batch-tokens", "3",
         "--profile-batch", "3", "--profile-steps", "2", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    assert set(data["offline"]) == {"decode_tok_s", "prefill_tok_s", "batch2_tok_s", "batch3_tok_s"}
    assert all(v > 0 for v in data["offline"].values())
    prof = data["profile"]
    assert prof["batch"] == 3 and 0 < prof["host_share"] < 1
    assert "device: Device(" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--decode-tokens", "0"], "--decode-tokens must be >= 1, got 0"),
        # was a ZeroDivisionError after the whole offline run
        (
            ["--profile-steps", "0"],
            "--profile-steps must be >= 1 (or --profile-batch 0 for no profile), got 0",
        ),
        (["--profile-batch", "-1"], "--profile-batch must be >= 0 (0: no profile), got -1"),
        (["--batch-sizes", "4", "0"], "--batch-sizes must all be >= 1, got 0"),
    ],
)
def test_bench_rejects_bad_counts_before_loading(flags, message, capsys) -> None:
    # A MODEL that does not exist: the flags must be refused before any loading.
    assert main(["bench", "/nonexistent/model.gguf", *flags]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_bench_without_a_profile_skips_it(tmp_path: Path) -> None:
    _, model_dir = make_tiny_model_dir(tmp_path / "m")
    out = tmp_path / "bench.json"
    code = main(
        ["bench", str(model_dir), "--decode-tokens", "2", "--prefill-tokens", "4",
         "--prompt-tokens", "4", "--batch-sizes", "--profile-batch", "0",
         "--profile-steps", "0", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    assert "profile" not in json.loads(out.read_text())


def test_mlxserve_fit_counts_blocks_and_shares_the_prefix() -> None:
    # Budget 10 blocks of 4 tokens. Requests of 5, 8, 9 tokens need 2, 2, 3 blocks.
    assert memory.fit_mlxserve([5, 8, 9, 4], budget_tokens=40, block_size=4) == 4
    assert memory.fit_mlxserve([5, 8, 9, 13], budget_tokens=40, block_size=4) == 3
    # An 8-token shared prefix is 2 blocks held once: 2 + (5+8 -> 4 - 2) * n.
    assert memory.fit_mlxserve([5] * 10, budget_tokens=40, block_size=4, shared_prefix=8) == 4


def test_mlx_lm_fit_pads_every_row_to_the_longest_in_256_steps() -> None:
    # 300 tokens -> 512 per row; 3 rows = 1536 <= 1600, a 4th would need 2048.
    assert memory.fit_mlx_lm([300, 10, 10, 10], budget_tokens=1600) == 3
    assert memory.fit_mlx_lm([10, 10, 10, 10, 10, 10], budget_tokens=1600) == 6
    assert memory.fit_mlx_lm([10, 600], budget_tokens=1000) == 1  # 2 x 768 > 1000


@pytest.mark.skipif(blas.gemv_shim() is None, reason="the sgemm -> sgemv shim is not loaded")
def test_one_row_matmuls_through_the_gemv_shim_match_numpy() -> None:
    shim = ctypes.CDLL(blas.gemv_shim())
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 40)).astype(np.float32)  # (out, in)
    x = rng.standard_normal((1, 40)).astype(np.float32)
    before = shim.mlxserve_num_gemv_calls()
    cases = {
        "x @ w.T (weights stored (out, in))": mx.array(x) @ mx.array(w).T,
        "x @ w2 (weights stored (in, out))": mx.array(x) @ mx.array(np.ascontiguousarray(w.T)),
        "a transposed row": mx.array(np.ascontiguousarray(x.T)).T @ mx.array(w).T,
    }
    mx.eval(list(cases.values()))
    assert shim.mlxserve_num_gemv_calls() - before >= len(cases)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    for name, got in cases.items():
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5, err_msg=name)
    # More than one row goes to sgemm, with the same values.
    xs = rng.standard_normal((3, 40)).astype(np.float32)
    got = mx.array(xs) @ mx.array(w).T
    np.testing.assert_allclose(np.array(got), xs @ w.T, rtol=1e-5, atol=1e-5)


def test_window_itls_keeps_gaps_within_one_request_ending_in_the_window() -> None:
    from mlxserve.cli.bench.serving import window_itls

    requests = [[1.0, 2.0, 4.0, 7.0], [7.5, 8.0], [9.0]]
    # Gaps ending at 2, 4, 7 (first request), 8 (second); 7 -> 7.5 is a restart, not a gap.
    assert window_itls(requests, 0.0, 100.0) == [1.0, 2.0, 3.0, 0.5]
    assert window_itls(requests, 3.0, 7.0) == [2.0, 3.0]
    assert window_itls(requests, 7.1, 8.5) == [0.5]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_servers_peak_rss_counts_what_it_once_touched_and_not_its_parent() -> None:
    import subprocess
    import sys

    from mlxserve.cli.bench.serving import proc_status_mib, reap

    # The parent holds 256 MiB: ru_maxrss would count them (exec keeps the parent's
    # resident set at the fork when larger), the child's own peak must not.
    ballast = bytearray(256 << 20)
    ballast[::4096] = b"x" * len(ballast[::4096])
    # Touches 96 MiB, frees them, then waits.
    script = (
        "import time; b = bytearray(96 << 20); b[::4096] = b'x' * len(b[::4096]); "
        "del b; print('ok', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ok"
    peak = proc_status_mib(proc.pid, "VmHWM")
    proc.terminate()
    reap(proc, timeout_s=30)
    del ballast
    assert peak is not None and 96 <= peak < 96 + 64
    assert proc.returncode == -15 and proc.poll() == -15


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_servers_cpu_seconds_count_its_busy_loop() -> None:
    import subprocess
    import sys

    from mlxserve.cli.bench.serving import cpu_seconds, reap

    script = (
        "import time; t = time.process_time()\n"
        "while time.process_time() - t < 0.5: pass\n"
        "print('ok', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ok"
    used = cpu_seconds(proc.pid)
    proc.terminate()
    reap(proc, timeout_s=30)
    assert used is not None and 0.5 <= used < 2.0


def test_background_streams_restart_when_an_engine_ends_them() -> None:
    import asyncio

    import httpx

    from mlxserve.cli.bench.serving import BackgroundStreams

    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        events = [{"choices": [{"text": f"t{i}"}]} for i in range(3)]  # ends after 3 tokens
        lines = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=lines, headers={"content-type": "text/event-stream"})

    async def run() -> BackgroundStreams:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            streams = BackgroundStreams(c, ["a", "b"], max_tokens=3)
            await streams.wait_tokens(1, timeout_s=30)
            while streams.num_restarts < 6:
                await asyncio.sleep(0.01)
            assert streams.all_alive()
            await streams.stop()
        return streams

    streams = asyncio.run(run())
    assert streams.num_restarts >= 6 and {b["prompt"] for b in sent} == {"a", "b"}
    assert all(b["ignore_eos"] and b["max_tokens"] == 3 for b in sent)
    assert all(len(times) == 3 for times in streams.requests[:6])


def test_structured_outputs_bench_runs_on_the_tiny_model(tmp_path: Path) -> None:
    from bench import structured_outputs

    _, model_dir = make_tiny_model_dir(tmp_path / "m")
    out = tmp_path / "so.json"
    args = [str(model_dir), "--num-prompts", "3", "--prompt-tokens", "8", "--max-tokens", "6"]
    assert structured_outputs.main([*args, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    # Both batches generate exactly max_tokens per request: the same work, comparable.
    assert data["unconstrained"]["output_tokens"] == data["json_schema"]["output_tokens"] == 18
    assert data["json_schema"]["mask_ms_per_step"] > 0 == data["unconstrained"]["mask_ms_per_step"]
    assert data["streams_while_compiling"]["compile_s"] > 0


def test_grammar_backends_bench_measures_llguidance(tmp_path: Path) -> None:
    from bench import grammar_backends

    out = tmp_path / "backends.json"
    assert grammar_backends.main(["--backends", "llguidance", "--json", str(out)]) == 0
    numbers = json.loads(out.read_text())["llguidance"]
    assert numbers["mask_us_mean"] > 0 and numbers["compile_s"] > 0
    # The keywords llguidance does not implement are refused, never ignored.
    assert all(v.startswith("refused") for v in numbers["keywords"].values())


def test_spec_decode_bench_runs_on_the_tiny_model(tmp_path: Path) -> None:
    from bench import spec_decode

    _, model_dir = make_tiny_model_dir(tmp_path / "m")
    # edit, copy and the other edit shapes are one code path (bench/edit_workload.py).
    argv = [str(model_dir), "--max-tokens", "6", "--workloads", "edit,edit-old"]
    argv += ["--batch", "2", "--always", "--disable-by-batch-size", "4"]
    results = spec_decode.main(argv)
    assert set(results) == {"edit", "edit-old", "batch2"}
    for row in results.values():
        assert row["same_tokens"]  # greedy: speculation never changes the tokens
        assert row["plain"]["drafted"] == 0 and row["ngram"]["output_tokens"] > 0
        assert row["ngram:always"]["cost_switches"] == 0  # no cost back-off there
        # The model drafting for itself: its greedy drafts are the target's own tokens.
        assert row["draft:self"]["accepted"] == row["draft:self"]["drafted"]
    # The replay of plain's output (bench/spec_sim.py) predicts what the n-gram engine
    # without the cost back-off drafted and accepted, token for token.
    for name, row in results.items():
        if "replay" in row:
            replayed = row["replay"]["k=4 lookup 2-4"]
            counted = row["ngram:always"]
            assert (replayed["drafted"], replayed["accepted"]) == (
                counted["drafted"],
                counted["accepted"],
            ), name
    # The edit's score: 6 random tokens after the prefilled first line reproduce at most
    # that line and those tokens of the file.
    did = results["edit"]["did"]
    assert did["reproduced"] <= did["code_tokens"] <= did["file_tokens"]


def test_edit_workload_scores_what_the_answer_reproduced(tmp_path: Path) -> None:
    from bench import edit_workload as ew
    from mlxserve.tokenizer import Tokenizer

    write_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    lines = ew.SOURCE.read_text().splitlines(keepends=True)[:100]  # five uses of the name
    source = "".join(lines)
    uses = source.count(ew.OLD_NAME)  # the attribute is never part of a longer name here
    assert uses == 5 and ew.NEW_NAME not in source
    text, given = ew.prompt(tok, "prefill", source)
    assert text.endswith("```python\n" + lines[0]) and given == "```python\n" + lines[0]
    edited = source.replace(ew.OLD_NAME, ew.NEW_NAME)

    def did(shape: str, generated: str) -> dict:
        return ew.score(tok, shape, given, generated, source)

    # The whole edited file, closed: everything reproduced, every use renamed.
    s = did("prefill", edited[len(lines[0]) :] + "```\nDone.")
    assert s["reproduced"] == s["file_tokens"] == s["exact_prefix"] == len(tok.encode(edited))
    assert (s["renamed"], s["old_left"], s["closed"]) == (uses, 0, True)
    # The file copied unchanged and cut off: the uses left as they were.
    s = did("prefill", source[len(lines[0]) :])
    assert (s["renamed"], s["old_left"], s["closed"]) == (0, uses, False)
    assert s["exact_prefix"] < s["reproduced"] < s["file_tokens"]
    assert did("copy", source[len(lines[0]) :])["reproduced"] == len(tok.encode(source))
    # A description instead of code: nothing reproduced.
    assert ew.score(tok, "chat", "", "This file defines a queue.", source)["code_tokens"] == 0


def test_kv_cache_dtype_bench_runs_on_the_tiny_model(tmp_path: Path) -> None:
    from bench import kv_cache_dtype

    _, model_dir = make_tiny_model_dir(tmp_path / "m")
    args = [str(model_dir), "--kv-budget-mb", "1", "--length", "64", "--prompts", "2"]
    args += ["--tokens", "4", "--batch", "2", "--decode-tokens", "3", "--no-simulated"]
    data = kv_cache_dtype.main(args)["dtypes"]
    # The tiny model: 2 layers x 2 KV heads of 16 per token; int8 rows are 16 + 4 bytes.
    assert data["auto"]["bytes_per_block"] == 16 * 2 * 2 * 2 * 16 * 4
    assert data["int8"]["bytes_per_block"] == 16 * 2 * 2 * 2 * 20
    assert data["int8"]["blocks"] == 2**20 // data["int8"]["bytes_per_block"]
    assert data["int8"]["requests_that_fit"] == data["int8"]["blocks"] // 4
    assert 0 <= data["int8"]["agreement"] <= 1 and data["int8"]["decode_tok_s"] > 0


def test_decode_profile_runs_a_step_and_the_verification_rows(tmp_path: Path) -> None:
    """bench/decode_profile.py end to end on the tiny model (it reaches into the runner
    and the ops, so a rename there breaks it: seen once, the removed write_kv_and_attend)."""
    from bench import decode_profile

    _, model_dir = make_tiny_model_dir(tmp_path / "m")
    out = tmp_path / "profile.json"
    argv = [str(model_dir), "--batch", "2", "--steps", "3", "--repeats", "1"]
    argv += ["--verify-rows", "1", "3", "--verify-context", "20", "--json", str(out)]
    argv += ["--overlap-rounds", "1"]
    assert decode_profile.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["steps"]["2"]["step"] > 0 and data["steps"]["2"]["ops"] > 0
    assert {m: data["overlap"]["2"][m]["step"] > 0 for m in ("async", "sync")} == {
        "async": True,
        "sync": True,
    }
    assert set(data["verification"]) == {"1", "3"}
    assert data["verification"]["1"]["forward"]["vs_1_row"] == 1.0
