"""OpenAI's Responses API with the official openai SDK against `mlxserve serve` (tiny model).

Oracles: mlx-lm's greedy tokens for the same weights, on prompts rendered by hand (ChatML)
and tokenized by the `tokenizers` library; the Responses event types of the SDK.
"""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI
from tokenizers import Tokenizer

from tests.engine_helpers import make_tiny_model_dir
from tests.model_helpers import mlx_lm_greedy
from tests.server_harness import metric, read_metrics, start_server

N = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=13)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    s = start_server([str(tiny[1]), "--served-model-name", "tiny", "--dtype", "float32"], log)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy(tiny, *turns: tuple[str, str]) -> tuple[str, int]:
    model, model_dir = tiny
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns)
    ids = tok.encode(prompt + "<|im_start|>assistant\n").ids
    tokens, _ = mlx_lm_greedy(model, ids, N)
    return tok.decode(tokens), len(ids)


def create(client, **kwargs):
    return client.responses.create(
        **({"model": "tiny", "temperature": 0, "max_output_tokens": N} | kwargs)
    )


def test_text_matches_mlx_lm_and_is_retrievable(client, tiny) -> None:
    want, num_prompt = greedy(tiny, ("system", "Be brief."), ("user", "Hello there"))
    resp = create(client, input="Hello there", instructions="Be brief.")
    assert resp.output_text == want and resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (num_prompt, N)
    assert client.responses.retrieve(resp.id).output_text == want
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}]
    assert create(client, input=items, instructions="Be brief.").output_text == want


def test_previous_response_id_continues_the_conversation(client, tiny) -> None:
    first = create(client, input="Hi")
    want, _ = greedy(tiny, ("user", "Hi"), ("assistant", first.output_text), ("user", "More"))
    second = create(client, input="More", previous_response_id=first.id)
    assert second.output_text == want and second.previous_response_id == first.id
    unstored = create(client, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        create(client, input="x", previous_response_id=unstored.id)


def test_stream_events(client, tiny) -> None:
    want, _ = greedy(tiny, ("user", "Hello there"))
    events = list(create(client, input="Hello there", stream=True))
    kinds = [e.type for e in events]
    n = kinds.count("response.output_text.delta")
    assert n >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * n,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want == events[-1].response.output_text


def test_errors_name_the_field(client, server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        create(client, input="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        create(client, input=[{"type": "web_search_call", "id": "w"}])
    assert e.value.body["param"] == "input"
    values = read_metrics(server.url)
    assert metric(values, "vllm:kv_cache_usage_perc", model_name="tiny") == 0
