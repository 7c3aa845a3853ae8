"""A stop string that completes on the last token the request may produce: the answer
ends there with finish_reason "stop" (as vLLM), not "length"."""

from __future__ import annotations

from mlxserve import LLM, SamplingParams


def test_stop_string_on_the_last_allowed_token_is_a_stop(smollm2_gguf) -> None:
    llm = LLM(str(smollm2_gguf), num_blocks=64, max_model_len=256)
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (base,) = llm.generate([prompt], greedy)
    full = base.outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 8
    # Stop on the last 3 characters of the 8-token answer: they complete on token 8 only.
    stop = full.text[-3:]
    assert full.text.find(stop) == len(full.text) - 3, full.text
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop])
    (out,) = llm.generate([prompt], params)
    got = out.outputs[0]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop)
    assert got.text == full.text[:-3] and got.token_ids == full.token_ids
