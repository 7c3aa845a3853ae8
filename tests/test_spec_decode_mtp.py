"""MTP speculative decoding (the checkpoint's own MTP layer drafts) on tiny random models.

Targets: the zoo's tiny glm4_moe and mimo with an MTP layer added under the HF names
(tests/mtp_helpers.py). Oracles: the engine without speculation (greedy outputs), a dense
MTP layer written from the HF/vLLM modeling code's math (the layer's outputs, and every
draft the engine proposes), the target's softmax from mlx-lm (sampling).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxserve import LLM, SamplingParams
from mlxserve.exceptions import ParameterError
from mlxserve.kv_cache_spec import uniform_layout
from mlxserve.models.base import KVCache
from mlxserve.ops import AttentionMetadata
from mlxserve.sampling_params import StructuredOutputsParams
from tests.chi_square import assert_second_tokens_fit
from tests.engine_helpers import VOCAB_SIZE, write_tokenizer
from tests.model_helpers import make_mlx_lm_checkpoint
from tests.mtp_helpers import MTP_TYPES, DenseMtp, make_mtp_model_dir, mtp_config
from tests.test_spec_decode_engine import greedy, prompts
from tests.zoo_configs import ZOO


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """model_type -> (mlx-lm target, model dir, the MTP tensors by HF name)."""
    root = tmp_path_factory.mktemp("mtp")
    return {t: make_mtp_model_dir(root / t, t, seed=5) for t in MTP_TYPES}


@pytest.fixture(scope="module")
def references(models) -> dict[str, list[list[int]]]:
    return {t: greedy(LLM(str(d), num_blocks=512), prompts()) for t, (_, d, _) in models.items()}


def mtp_llm(model_dir, k: int = 3, **kwargs) -> LLM:
    # No back-off: a random MTP layer's drafts are rarely accepted, and every step's
    # drafts are what is tested.
    spec = {
        "method": "mtp",
        "num_speculative_tokens": k,
        "disable_by_batch_size": 64,
        "min_acceptance_rate": 0.0,
        "disable_by_cost": False,
    }
    return LLM(str(model_dir), speculative_config=spec, **kwargs)


@pytest.mark.parametrize("model_type", MTP_TYPES)
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_blocks=512),
        dict(num_blocks=512, max_num_batched_tokens=16),  # chunked prefill
        dict(num_blocks=18, block_size=8, max_model_len=128),  # preemption forced
    ],
    ids=["batched", "budget16", "preemption"],
)
def test_greedy_with_mtp_equals_without_speculation(models, references, model_type, kwargs):
    _, model_dir, _ = models[model_type]
    llm = mtp_llm(model_dir, **kwargs)
    llm.engine.runner.pool_watch.every = 1  # every step's pool writes checked: in place
    assert greedy(llm, prompts()) == references[model_type]
    assert llm.engine.runner.pool_watch.num_copied_steps == 0
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 100
    if kwargs["num_blocks"] < 512:
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("model_type", MTP_TYPES)
def test_the_mtp_layer_on_the_pool_matches_the_dense_oracle(models, model_type) -> None:
    """The loaded layer (weight names, expert stacking, concatenation order, norms, head)
    over a 21-token prompt in two chunks on the paged pool, against the dense layer."""
    oracle, model_dir, weights = models[model_type]
    layer = mtp_llm(model_dir, num_blocks=64).engine.runner.drafter.model
    dense = DenseMtp(oracle, model_type, weights)
    tokens = prompts(3)[1][:22]
    hidden = dense.target_hidden(tokens[:-1])  # (21, hidden)
    want = dense.run(tokens[1:], hidden)
    cache = KVCache.allocate_layout(
        uniform_layout(1, layer.num_kv_heads, layer.head_dim), 8, 4, mx.float32
    )
    table = [5, 2, 7, 1, 3, 6]  # shuffled blocks of 4
    got = []
    for start, end in ((0, 13), (13, 21)):
        md = AttentionMetadata.build([end - start], [end], [table], 4)
        got.append(
            layer.forward(
                mx.array(tokens[start + 1 : end + 1]),
                mx.arange(start, end, dtype=mx.int32),
                hidden[start:end],
                md,
                cache,
            )
        )
    got = mx.concatenate(got)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(
        np.array(layer.logits(got)), np.array(dense.logits(want)), atol=2e-4, rtol=1e-4
    )


@pytest.mark.parametrize("model_type", MTP_TYPES)
def test_every_draft_is_the_dense_oracles(models, model_type) -> None:
    """Each step's k greedy drafts of every request (batched, staggered by a small budget,
    prefix hits on a shared 40-token prefix) are the dense layer's: its K/V must hold
    exactly what the target computed, whichever step computed it. Blocks of 8: the shared
    prefix ends at a block boundary, where the MTP K/V of a cached block's last position
    depends on the token after the block (so a hit recomputes its last block)."""
    oracle, model_dir, weights = models[model_type]
    llm = mtp_llm(model_dir, k=3, num_blocks=512, block_size=8, max_num_batched_tokens=24)
    drafter = llm.engine.runner.drafter
    seen: list[tuple[list[tuple[list[int], int]], object]] = []  # ((tokens, k) each, drafts)
    propose = drafter.propose

    def spy(so, sampling):
        proposal = propose(so, sampling)
        if proposal is not None:
            drafting = [r for r in so.scheduled_requests if so.draft_token_ids.get(r.request_id)]
            requests = [
                (list(r.all_token_ids), len(so.draft_token_ids[r.request_id])) for r in drafting
            ]
            seen.append((requests, proposal))
        return proposal

    drafter.propose = spy
    ps = prompts(7)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # A constrained request (no drafts) in the batch: the steps it shares are sampled
    # after the grammar masks, and the MTP layer follows them then.
    regex = StructuredOutputsParams(regex="[a-z ]{4,30}\\.")
    constrained = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=regex)
    llm.generate([ps[0], ps[3], ps[6], ps[2], ps[1]], [params] * 4 + [constrained], use_tqdm=False)
    assert llm.engine.get_stats().prefix_cache_hits > 0
    assert llm.engine.runner.num_mask_steps > 0
    dense = DenseMtp(oracle, model_type, weights)
    checked = 0
    for requests, proposal in seen:
        drafts = iter(np.array(proposal.token_ids).tolist())
        for tokens, n in requests:
            got = [next(drafts) for _ in range(n)]
            want, margins = dense.drafts(tokens, n)
            for j in range(n):  # up to the first near-tie (float order may flip it)
                if margins[j] < 1e-3:
                    break
                assert got[j] == want[j], (tokens, got, want)
                checked += 1
    assert checked > 40


def test_sampled_tokens_keep_the_target_distribution(models) -> None:
    """Chi-square: the 2nd token of many sampled requests, drafted by the MTP layer (q =
    its softmax at the request's temperature) and verified, against the target's
    distribution from mlx-lm: P(t2) = sum over t1 of P(t1) P(t2 | t1)."""
    oracle, model_dir, _ = models["mimo"]
    temperature, num_samples = 0.7, 1000
    prompt = [278] + [344] * 10
    spec = {
        "method": "mtp",
        "num_speculative_tokens": 1,
        "disable_by_batch_size": 256,
        "disable_by_cost": False,
    }
    llm = LLM(str(model_dir), max_num_seqs=256, seed=0, speculative_config=spec)
    stats = assert_second_tokens_fit(llm, oracle, prompt, temperature, num_samples)
    assert stats.spec_decode_num_accepted_tokens > 0


def test_a_checkpoint_without_mtp_weights_is_refused(tmp_path) -> None:
    _, plain = make_mlx_lm_checkpoint(tmp_path / "plain", mtp_config("glm4_moe"))
    write_tokenizer(plain)
    with pytest.raises(ParameterError) as e:
        mtp_llm(plain, num_blocks=64)
    assert e.value.parameter == "speculative_config.method"
    assert "no MTP layer weights" in str(e.value) and "model.layers.2." in str(e.value)


@pytest.mark.parametrize(
    ("model_type", "why"),
    [("llama", "supported for glm4_moe, mimo"), ("qwen3_next", "recurrent layers")],
)
def test_other_architectures_are_refused(tmp_path, model_type, why) -> None:
    config = ZOO[model_type] | {"vocab_size": VOCAB_SIZE}
    _, model_dir = make_mlx_lm_checkpoint(tmp_path / model_type, config)
    write_tokenizer(model_dir)
    with pytest.raises(ParameterError) as e:
        mtp_llm(model_dir, num_blocks=64)
    assert e.value.parameter == "speculative_config.method" and why in str(e.value)


def test_vllm_method_names_and_refusals_in_the_config() -> None:
    from mlxserve.config import EngineConfig

    for alias in ("mtp", "deepseek_mtp", "mimo_mtp", "glm4_moe_mtp"):
        config = EngineConfig(speculative_config={"method": alias})
        assert config.speculative_config.method == "mtp"
    with pytest.raises(ParameterError) as e:
        EngineConfig(speculative_config={"method": "mtp", "model": "x"})
    assert e.value.parameter == "speculative_config.model"
    for parallel in ("tensor_parallel_size", "pipeline_parallel_size"):
        with pytest.raises(ParameterError) as e:
            EngineConfig(speculative_config={"method": "mtp"}, **{parallel: 2})
        assert e.value.parameter == parallel and "MTP" in str(e.value)


def test_an_mtp_layer_that_predicts_as_the_target_has_every_draft_accepted(models, tmp_path):
    """Self-consistency: a mimo target whose layers add nothing (o_proj, down_proj zero)
    predicts the next token from the current one; an MTP layer that passes the normed
    embedding of the token after its position through (input_proj = [0 | I], its block
    adding nothing, final norm = the target's) predicts the same. Every greedy draft is
    then accepted: the accepted-draft paths (next token, kept g) run on every step."""
    import shutil

    _, model_dir, _ = models["mimo"]
    out = tmp_path / "bigram"
    shutil.copytree(model_dir, out)
    weights = dict(mx.load(str(out / "model.safetensors")))
    hidden = mtp_config("mimo")["hidden_size"]
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(w)
    mtp = "model.mtp_layers.0."
    weights[mtp + "token_layernorm.weight"] = mx.ones((hidden,))
    weights[mtp + "final_layernorm.weight"] = weights["model.norm.weight"]
    eye = mx.eye(hidden)
    weights[mtp + "input_proj.weight"] = mx.concatenate([mx.zeros_like(eye), eye], axis=1)
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    base = LLM(str(out), num_blocks=256)
    # Budget 11: the 23-token prompt's last token is left alone (chunks 11, 11, 1) and
    # verifies drafts from the g of a prompt chunk's last row.
    llm = mtp_llm(out, k=4, num_blocks=256, max_num_batched_tokens=11)
    ps = prompts(6) + [list(range(3, 26))]
    assert greedy(llm, ps) == greedy(base, ps)
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 60
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_speculating_plain_and_constrained_requests_share_steps(models, kv_cache_dtype) -> None:
    """Requests that do not speculate (a penalty, a regex) beside ones that do: the MTP
    layer follows them all (a constrained part's rows after its masked sampling), and
    every output is the one without speculation (int8 KV: the MTP pool's rows too)."""
    _, model_dir, _ = models["glm4_moe"]
    base = LLM(str(model_dir), num_blocks=512, kv_cache_dtype=kv_cache_dtype)
    llm = mtp_llm(model_dir, num_blocks=512, kv_cache_dtype=kv_cache_dtype)
    llm.engine.runner.pool_watch.every = 1
    ps = prompts(6)
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    params = [
        free,
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(
            temperature=0.0,
            max_tokens=16,
            structured_outputs=StructuredOutputsParams(regex="[a-z ]{4,12}\\."),
        ),
    ] * 2
    want = base.generate(ps, params, use_tqdm=False)
    got = llm.generate(ps, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert llm.engine.get_stats().spec_decode_num_draft_tokens > 20
    assert llm.engine.runner.pool_watch.num_copied_steps == 0  # the MTP pool in place too
    if kv_cache_dtype == "int8":
        runner = llm.engine.runner
        assert runner.drafter.kv_cache.keys[0].dtype == runner.kv_cache.keys[0].dtype == mx.int8
