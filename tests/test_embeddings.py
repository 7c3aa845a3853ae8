"""LLM.embed: pooled final hidden states, batched through the one scheduler.

Oracle: mlx-lm's implementation of the same tiny weights (its decoder stack returns the
final-norm hidden states), pooled and normalized here with numpy.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlxserve import LLM, PoolingParams, SamplingParams
from mlxserve.exceptions import ParameterError
from tests.engine_helpers import make_tiny_model_dir

PROMPTS = [[5, 9, 17], list(range(20, 61)), [7] * 19, list(range(100, 123))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def oracle_hidden(oracle, tokens: list[int]) -> np.ndarray:  # (len(tokens), hidden)
    h = oracle.model(mx.array(tokens, dtype=mx.int32)[None])[0]
    return np.array(h.astype(mx.float32), dtype=np.float64)


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def vectors(llm: LLM, prompts, **kwargs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False, **kwargs)])


def test_last_token_pooling_matches_mlx_lm_and_batches_like_one_by_one(tiny) -> None:
    oracle, model_dir = tiny
    # A small step budget: the long prompts are computed in chunks, beside each other.
    llm = LLM(str(model_dir), dtype="float32", num_blocks=64, max_num_batched_tokens=16)
    batch = vectors(llm, PROMPTS)
    expected = np.array([unit(oracle_hidden(oracle, p)[-1]) for p in PROMPTS])
    assert batch.shape == (len(PROMPTS), oracle.args.hidden_size)
    np.testing.assert_allclose(batch, expected, atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-6)
    alone = np.array([vectors(llm, [p])[0] for p in PROMPTS])  # prefix cache hits now
    np.testing.assert_allclose(batch, alone, atol=1e-5)
    again = vectors(llm, [PROMPTS[1], PROMPTS[1]])
    np.testing.assert_allclose(again[0], again[1], atol=1e-5)
    assert llm.engine.get_stats().kv_cache_usage == 0


def test_mean_pooling_from_the_sentence_transformers_config(tiny, tmp_path) -> None:
    oracle, model_dir = tiny
    mean_dir = tmp_path / "mean"
    mean_dir.mkdir()
    for f in model_dir.iterdir():
        (mean_dir / f.name).symlink_to(f)
    modules = [
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.Pooling"}
    ]
    (mean_dir / "modules.json").write_text(json.dumps(modules))
    (mean_dir / "1_Pooling").mkdir()
    (mean_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": 1}))
    llm = LLM(str(mean_dir), dtype="float32", num_blocks=64, max_num_batched_tokens=16)
    vecs = vectors(llm, PROMPTS)
    expected = np.array([unit(oracle_hidden(oracle, p).mean(axis=0)) for p in PROMPTS])
    np.testing.assert_allclose(vecs, expected, atol=1e-4)
    raw = vectors(llm, [PROMPTS[0]], pooling_params=PoolingParams(normalize=False))[0]
    np.testing.assert_allclose(raw, oracle_hidden(oracle, PROMPTS[0]).mean(axis=0), atol=1e-4)


def test_embeddings_share_steps_with_generation(tiny) -> None:
    _, model_dir = tiny
    llm = LLM(str(model_dir), dtype="float32", num_blocks=64, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0].outputs[0].token_ids
    embedded = vectors(llm, [PROMPTS[1]])[0]
    engine = llm.engine
    engine.add_request("gen", PROMPTS[3], params)
    engine.add_request("emb", PROMPTS[1], pooling_params=PoolingParams())
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["gen"].outputs[0].token_ids == alone
    np.testing.assert_allclose(finals["emb"].embedding, embedded, atol=1e-5)


def test_dimensions_only_for_matryoshka_models(tiny, tmp_path) -> None:
    oracle, model_dir = tiny
    llm = LLM(str(model_dir), dtype="float32", num_blocks=32)
    with pytest.raises(ParameterError, match="dimensions 8: this model was not trained") as e:
        llm.embed([PROMPTS[0]], PoolingParams(dimensions=8), use_tqdm=False)
    assert e.value.parameter == "dimensions"
    with pytest.raises(ParameterError, match="dimensions must be an integer >= 1"):
        PoolingParams(dimensions=0)
    mat_dir = tmp_path / "matryoshka"
    mat_dir.mkdir()
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (mat_dir / f.name).symlink_to(f)
    config = json.loads((model_dir / "config.json").read_text())
    (mat_dir / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": [8, 64]}))
    llm = LLM(str(mat_dir), dtype="float32", num_blocks=32)
    vec = vectors(llm, [PROMPTS[0]], pooling_params=PoolingParams(dimensions=8))[0]
    np.testing.assert_allclose(vec, unit(oracle_hidden(oracle, PROMPTS[0])[-1][:8]), atol=1e-4)
    with pytest.raises(ParameterError, match="at most 64"):
        llm.embed([PROMPTS[0]], PoolingParams(dimensions=65), use_tqdm=False)


def test_an_mlx_lm_adapted_model_embeds_as_mlx_lm(tmp_path) -> None:
    """gpt-oss (sliding window, sinks, MoE) through the adapter: its decoder stack's output."""
    from tests.engine_helpers import VOCAB_SIZE, write_tokenizer
    from tests.model_helpers import make_mlx_lm_checkpoint
    from tests.zoo_configs import ZOO

    oracle, path = make_mlx_lm_checkpoint(tmp_path, ZOO["gpt_oss"] | {"vocab_size": VOCAB_SIZE})
    write_tokenizer(path)
    llm = LLM(str(path), num_blocks=64, block_size=4, max_num_batched_tokens=16)
    vecs = vectors(llm, PROMPTS[:2])
    expected = np.array([unit(oracle_hidden(oracle, p)[-1]) for p in PROMPTS[:2]])
    np.testing.assert_allclose(vecs, expected, atol=1e-4)
