"""Soak, short form: `mlxserve serve` on the embedded SmolLM2 under 8 clients for ~30 s.

Mixed APIs (chat and completions, streamed or not, n=2, logprobs, stop strings, usage
chunks, /tokenize), a long shared system prompt on 40% of the calls, 20% of the calls
abandoned by their client part-way. The server must answer every call it was not
abandoned on with a well-formed response, agree with itself (greedy and seeded answers,
prompt token counts), go back to idle (running, waiting, KV usage 0), not grow its RSS
past a bound, and still give the same greedy answers as before. The workload and checks
are tests/soak_harness.py; scripts/soak.py runs the long form (64 clients, minutes).

The figures (calls, aborted, tokens, latencies, RSS) are printed and written to
soak-report.json in the test's temporary directory; the assertion message repeats them.
"""

from __future__ import annotations

import json
import random

import pytest

from tests.server_harness import start_server
from tests.soak_harness import SoakConfig, run_soak, summary_line
from tests.soak_workload import draw_call

# A burst (~8-10 s on 2 idle cores), 3 s of warm-up, 15 s of load. The seed is one whose
# clients' first calls of the load already cover the whole mix (checked below), so the
# short load cannot miss a kind of call however few calls the machine manages.
CONFIG = SoakConfig(clients=8, warmup=3.0, duration=15.0, seed=110)


def first_calls(config: SoakConfig) -> list:
    """The call each client of the load phase sends first (soak_harness.load's generators)."""
    return [
        draw_call(
            random.Random(f"{config.seed}/load/{i}"),
            "model",
            config.disconnect_rate,
            config.shared_prefix_rate,
        )
        for i in range(config.clients)
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    s = start_server(["--disable-log-stats"], log)
    yield s
    s.stop()


def test_soak_8_clients_mixed_apis_with_disconnects(server, tmp_path) -> None:
    first = first_calls(CONFIG)
    kinds = {(c.kind, c.stream) for c in first}
    assert len(kinds) == 5, kinds  # chat and completions, streamed or not; /tokenize
    assert any(c.stream and c.disconnect_after for c in first)  # a stream left part-way
    assert any(c.n == 2 for c in first) and any(c.logprobs for c in first)
    assert any(c.stop for c in first) and any(c.prompt_key[1] for c in first)  # shared prefix
    report = run_soak(server.url, server.proc.pid, CONFIG, server_log=server.log_path)
    (tmp_path / "soak-report.json").write_text(json.dumps(report, indent=1))
    print(f"soak report: {tmp_path / 'soak-report.json'}")
    load = report["load"]
    # The check has teeth: the mix really ran (calls of every kind, some abandoned), and
    # at least every client's first call (run to its end past the deadline) was answered
    # or abandoned as planned, however few calls a loaded machine manages in the window.
    planned_ok = sum(1 for c in first if c.disconnect_after is None and c.cancel_after is None)
    assert load["ok"] >= planned_ok and load["aborted"] >= 1, summary_line(report)
    assert len(load["by_kind"]) == 5, summary_line(report)
    assert report["server"]["vllm:generation_tokens_total"] > 0
    assert report["failures"] == [], summary_line(report)
