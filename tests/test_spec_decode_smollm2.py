"""N-gram speculation on the embedded SmolLM2: a "repeat this passage" prompt, where the
drafts copied from the prompt are accepted. The oracle is the same engine without
speculation (its greedy output is checked against llama.cpp and mlx-lm elsewhere)."""

from __future__ import annotations

import pytest

from mlxserve import LLM, SamplingParams

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. All that glitters is not gold."
)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_cost": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    return LLM(None, num_blocks=64), LLM(None, num_blocks=64, speculative_config=SPEC)


def chat(llm: LLM, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def test_repeating_a_passage_accepts_drafts_and_matches_plain_decoding(engines) -> None:
    base, spec = engines
    prompts = [
        chat(base, "Repeat the following text exactly, word for word:\n\n" + PASSAGE),
        chat(base, "What is the capital of France?"),  # little to copy: few drafts
    ]
    want = base.generate(prompts, GREEDY, use_tqdm=False)
    got = spec.generate(prompts, GREEDY, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
    assert "journey of a thousand miles" in got[0].outputs[0].text
    stats = spec.engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 10


def test_a_stop_string_among_accepted_drafts_ends_the_output_there(engines) -> None:
    base, spec = engines
    prompt = chat(base, "Repeat the following text exactly, word for word:\n\n" + PASSAGE)
    engine = spec.engine
    engine.add_request("r", prompt, GREEDY)
    chunks = []
    while engine.has_unfinished_requests():
        chunks += [out.outputs[0].text for out in engine.step(delta=True)]
    # A word that arrives inside a chunk of several tokens, not at its end: "thousand".
    chunk = next(c for c in chunks if "thousand" in c and not c.endswith("thousand"))
    assert chunk
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=["thousand"])
    want = base.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop" and want.text.endswith("journey of a ")
    assert (got.token_ids, got.text, got.finish_reason) == (
        want.token_ids,
        want.text,
        want.finish_reason,
    )


def test_smollm2_as_its_own_draft_model_matches_plain_decoding(engines) -> None:
    """The embedded model drafting for itself (speculative_config.model = its GGUF): the
    output equals plain decoding, and the drafts, being the model's own greedy choices
    computed on its own KV, are accepted (all but a near-tie's rounding)."""
    from mlxserve.loader import default_model_path

    base, _ = engines
    spec = {"model": str(default_model_path()), "num_speculative_tokens": 3}
    llm = LLM(None, num_blocks=64, speculative_config=spec)
    prompts = [chat(base, "Write a short story about a cat.")]
    # ignore_eos: an EOS among accepted drafts would end the count of accepted ones there.
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = base.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens >= 9
    assert stats.spec_decode_num_accepted_tokens >= 0.9 * stats.spec_decode_num_draft_tokens
