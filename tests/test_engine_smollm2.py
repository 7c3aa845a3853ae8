"""The engine on the embedded SmolLM2: batch invariance on a real quantized model.

Short prompts and few tokens: the CPU backend runs ~7 token-rows per second.
"""

from __future__ import annotations

import pytest

from mlxserve import LLM, SamplingParams

SUBJECTS = [
    "France",
    "Germany",
    "Italy",
    "Spain",
    "Japan",
    "China",
    "Brazil",
    "Canada",
    "Egypt",
    "Kenya",
    "India",
    "Peru",
    "Chile",
    "Norway",
    "Sweden",
    "Poland",
]
THINGS = [
    "food",
    "colour",
    "book",
    "song",
    "city",
    "animal",
    "sport",
    "game",
    "movie",
    "season",
    "flower",
    "tree",
    "bird",
    "fruit",
    "drink",
    "number",
]
PROMPTS = [f"The capital of {s} is" for s in SUBJECTS] + [f"My favourite {t} is" for t in THINGS]
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(None, num_blocks=128)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def run_all(**engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(None, **engine_args)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)], llm


def test_reference_is_sensible(reference) -> None:
    from mlxserve.tokenizer import Tokenizer
    from tests.paths import SMOLLM2_GGUF

    assert Tokenizer.from_gguf(SMOLLM2_GGUF).decode(reference[0]) == " Paris.\n"


def test_all_at_once_with_prefix_caching(reference) -> None:
    got, _ = run_all(num_blocks=128, max_num_batched_tokens=2048)
    assert got == reference


def test_chunked_prefill_without_prefix_caching(reference) -> None:
    got, _ = run_all(num_blocks=128, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert got == reference


def test_small_pool_forces_preemption(reference) -> None:
    # 9 usable blocks of 4 tokens hold 36 tokens: far fewer than 32 running requests need.
    got, llm = run_all(num_blocks=10, block_size=4, max_model_len=32, max_num_batched_tokens=64)
    assert got == reference
    assert llm.engine.scheduler.make_stats().num_preemptions > 0


def test_chat_renders_like_llama_cpp_and_answers() -> None:
    from tests.paths import llamacpp_oracle

    chats = llamacpp_oracle()["chat_template"][:2]
    llm = LLM(None, num_blocks=128)
    short = SamplingParams(temperature=0.0, max_tokens=2)
    outs = llm.chat([c["messages"] for c in chats], short, use_tqdm=False)
    assert [o.prompt for o in outs] == [c["prompt"] for c in chats]
    tok = llm.get_tokenizer()
    assert [tok.decode(o.prompt_token_ids, skip_special_tokens=False) for o in outs] == [
        c["prompt"] for c in chats
    ]
    # Response prefill (vLLM's continue_final_message): llama.cpp's prompt, then the start.
    start = "```python\n"
    (cont,) = llm.chat(
        [*chats[1]["messages"], {"role": "assistant", "content": start}],
        short,
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert cont.prompt == chats[1]["prompt"] + start
    (one,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France? Answer with one word."}],
        SamplingParams(temperature=0.0, max_tokens=12),
        use_tqdm=False,
    )
    assert one.outputs[0].text == "The capital of France is Paris."


def test_int8_greedy_bits_do_not_depend_on_chunks_prefix_hits_or_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The soak's near tie: with int8 activations one greedy request once got "... the
    Golden Delicious," and "... the Golden Delicious Golden" from one server. Its
    logprobs must be the same bits computed in 17-token chunks beside another request and
    after a prefix-cache hit (when prefill attention depended on the chunk's shape,
    chunking moved them by up to 0.4 nats)."""
    monkeypatch.setenv("MLXSERVE_CPU_INT8", "on")  # read when the model loads
    question = [{"role": "user", "content": "Name a fruit that is yellow."}]
    other = [{"role": "user", "content": "What do bees make?"}]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3)

    def answers(llm: LLM, *convs: list) -> list[tuple]:
        outs = llm.chat(list(convs), params, use_tqdm=False)
        return [(o.num_cached_tokens, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    llm = LLM(None, num_blocks=64, max_num_batched_tokens=17)
    beside, _ = answers(llm, question, other)  # 37 tokens in chunks shared with other
    (hit,) = answers(llm, question)  # 32 from the prefix cache, then 5 in one chunk
    assert beside[0] == 0 and hit[0] == 32
    assert hit[1:] == beside[1:]
