"""bench/zoo_vs_mlx_lm.py runs end to end on minuscule models, and its arithmetic is right."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import zoo_vs_mlx_lm as zoo_bench

TINY = [
    "--batch-sizes", "3", "--max-tokens", "4", "--single-tokens", "4",
    "--min-prompt", "4", "--max-prompt", "12", "--hidden", "64", "--head-dim", "16",
    "--layers", "4", "--experts", "4", "--top-k", "2", "--no-mlx-lm-openblas",
]  # fmt: skip


def test_both_engines_run_both_models_on_the_same_prompts(tmp_path: Path, capsys) -> None:
    out = tmp_path / "zoo.json"
    code = zoo_bench.main([*TINY, "--workdir", str(tmp_path / "w"), "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert set(data["models"]) == {"qwen3_moe", "qwen3_5"}
    for name, model in data["models"].items():
        assert model["config"]["model_type"] == name
        assert model["config"]["hidden_size"] == 64
        for case, prompts in (("single", 1), ("batch3", 3)):
            res = model["results"][case]
            for engine in ("mlxserve", "mlx-lm"):
                assert res[engine]["prefill_s"] > 0 and res[engine]["tok_s"] > 0, (name, case)
            ratios = res["mlxserve/mlx-lm"]
            assert ratios["prefill"] > 0 and ratios["tok_s"] > 0, (name, case)
            # 3 decode steps: on a busy machine noise can leave no decode rate (NaN).
            assert not ratios["decode_tok_s"] <= 0, (name, case)
            # Two independent implementations over 4 greedy steps of float32 tiny models:
            # equal tokens, which also shows both got the same prompts in the same order.
            agree = res["mlx-lm"]["agreement"]
            assert agree == {
                "identical": prompts,
                "prompts": prompts,
                "tokens_before_divergence": 4 * prompts,
                "tokens": 4 * prompts,
                "first_divergence": None,
            }, (name, case)
    text = capsys.readouterr().out
    assert "== qwen3_moe ==" in text and "== qwen3_5 ==" in text
    assert "mlxserve/mlx-lm" in text


def test_agreement_counts_tokens_up_to_each_divergence() -> None:
    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    theirs = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    assert zoo_bench.agreement(ours, theirs) == {
        "identical": 1,
        "prompts": 3,
        "tokens_before_divergence": 4 + 2 + 0,
        "tokens": 12,
        "first_divergence": 0,
    }


def test_case_numbers_take_the_best_round_and_pair_prefill_and_run_by_round() -> None:
    res = {"wall_s": [2.0, 1.8], "prefill_s": [0.5, 1.2]}
    nums = zoo_bench.case_numbers(res, num_prompts=4, tokens=10)
    # Decode rates per round: 36 / 1.5 = 24 and 36 / 0.6 = 60 (not 36 / (1.8 - 0.5)).
    assert nums == pytest.approx({"prefill_s": 0.5, "tok_s": 40 / 1.8, "decode_tok_s": 60.0})
    noisy = zoo_bench.case_numbers({"wall_s": [0.4], "prefill_s": [0.5]}, num_prompts=4, tokens=10)
    assert math.isnan(noisy["decode_tok_s"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--top-k", "5", "--experts", "4"], "--top-k (5) must be <= --experts (4)"),
        (["--vocab", "1000"], "--vocab must be in [4, 384]"),
        (["--min-prompt", "9", "--max-prompt", "8"], "--max-prompt (8) must be >= --min-prompt"),
        (["--batch-sizes", "0"], "--batch-sizes must all be >= 1"),
        (["--hidden", "100", "--head-dim", "32"], "--hidden (100) must be a multiple"),
    ],
)
def test_bad_sizes_are_refused_before_building_anything(flags, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        zoo_bench.parse_args(flags)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
