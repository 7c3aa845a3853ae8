"""Acceptance with the official openai client against `mlxserve serve` on the embedded
SmolLM2 (one real uvicorn subprocess for the module, API key from the environment).

Oracles: llama.cpp's greedy steps for the same GGUF (tests/fixtures), and the same
requests made one at a time. The examples in docs/serving.md's serve section run verbatim
(only the port differs).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.paths import CLEAR_GAP, ROOT
from tests.server_harness import metric, read_metrics, start_server

KEY = "sk-embedded-test-key"
MODEL = "SmolLM2-135M-Instruct"
SERVING_DOC = ROOT / "docs" / "serving.md"
# llama.cpp rounds activations to 8 bits inside quantized matmuls: logprobs differ a little.
LOGPROB_TOL = 0.25


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    s = start_server([], log, env={"MLXSERVE_API_KEY": KEY})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def test_models_list_and_retrieve(client) -> None:
    models = client.models.list()
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completions_match_llama_cpp_streamed_or_not(server, client, llamacpp_oracle) -> None:
    case = next(c for c in llamacpp_oracle["greedy"] if c["prompt"] == "The capital of France is")
    steps = case["steps"][:4]
    assert all(s["top"][0][1] - s["top"][1][1] > CLEAR_GAP for s in steps)  # clear argmax
    out = client.completions.create(
        model=MODEL, prompt=case["prompt"], max_tokens=4, temperature=0, logprobs=3
    )
    choice = out.choices[0]
    assert case["text"].startswith(choice.text) and len(choice.text) > 4
    assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(case["prompt_ids"]), 4)
    assert out.usage.total_tokens == len(case["prompt_ids"]) + 4
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    detok = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"})

    def text_of(token_id: int) -> str:
        return detok.post("/detokenize", json={"tokens": [token_id]}).json()["prompt"]

    lp = choice.logprobs
    for i, step in enumerate(steps):
        assert lp.tokens[i] == text_of(step["id"])
        assert lp.token_logprobs[i] == pytest.approx(step["logprob"], abs=LOGPROB_TOL)
        top = lp.top_logprobs[i]
        assert set(top) == {text_of(t) for t, _ in step["top"]}
        for t, want in step["top"]:
            assert top[text_of(t)] == pytest.approx(want, abs=LOGPROB_TOL)

    stream = client.completions.create(
        model=MODEL,
        prompt=case["prompt"],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == len(case["prompt_ids"])


def test_chat_stream_concatenates_to_the_non_streamed_reply(server, client) -> None:
    messages = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0
    )
    reply = out.choices[0].message
    assert reply.role == "assistant" and "Paris" in reply.content
    assert out.object == "chat.completion" and out.model == MODEL
    tokens = httpx.post(
        server.url + "/tokenize",
        json={"messages": messages},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()
    assert out.usage.prompt_tokens == tokens["count"]
    assert out.usage.completion_tokens <= 6
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [out.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        out.usage.prompt_tokens,
        out.usage.completion_tokens,
    )
    # Same prompt again: every full 16-token block of it comes from the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16


WORDS = "Paris Water Gold Snow Tea Rome Bread Iron Wind Salt Milk Music Python Ice Rain Sand"
PROMPTS = [f"{w} is" for w in WORDS.split()]


def test_16_concurrent_streaming_clients_match_one_at_a_time(server, client) -> None:
    aclient = AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)

    async def one(prompt: str) -> tuple[str, str | None]:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0, stream=True
        )
        parts, finish = [], None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def all_at_once() -> list[tuple[str, str | None]]:
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    together = asyncio.run(all_at_once())
    assert all(finish in ("stop", "length") for _, finish in together)
    alone = []
    for p in PROMPTS:
        stream = client.completions.create(
            model=MODEL, prompt=p, max_tokens=4, temperature=0, stream=True
        )
        alone.append("".join(c.choices[0].text for c in stream if c.choices))
    assert [text for text, _ in together] == alone
    assert len(set(alone)) > 8  # different prompts, different answers: the check has teeth
    values = read_metrics(server.url)
    assert metric(values, "vllm:num_requests_running", model_name=MODEL) == 0
    assert metric(values, "vllm:kv_cache_usage_perc", model_name=MODEL) == 0


def doc_blocks(language: str) -> list[str]:
    """Code blocks of docs/serving.md's `mlxserve serve` section (up to the next section)."""
    text = SERVING_DOC.read_text()
    section = text[text.index("## Serving: `mlxserve serve`") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def test_docs_examples_run_verbatim(server) -> None:
    env = dict(os.environ, MLXSERVE_API_KEY=KEY)
    port = str(server.port)
    curls = [b for b in doc_blocks("bash") if b.startswith("curl")]
    assert len(curls) >= 3 and all("Authorization: Bearer $MLXSERVE_API_KEY" in b for b in curls)
    for block in curls:
        cmd = block.strip().replace("localhost:8000", f"localhost:{port}")
        out = subprocess.run(
            ["bash", "-c", "set -eo pipefail; " + cmd + " --fail-with-body -sS"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert out.returncode == 0, (block, out.stdout, out.stderr)
        if '"stream": true' in block:
            events = [ln[6:] for ln in out.stdout.splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["usage"]["completion_tokens"] >= 1
        else:
            body = json.loads(out.stdout)
            assert body["choices"] and body["usage"]["completion_tokens"] >= 1
    (example,) = doc_blocks("python")
    code = example.replace("localhost:8000", f"localhost:{port}")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"['{MODEL}']") and "prompt +" in out.stdout
