"""Anthropic's Messages API with the official `anthropic` SDK against `mlxserve serve` (tiny model).

Oracles: mlx-lm's greedy tokens for the same weights, on prompts rendered by hand (ChatML)
and tokenized by the `tokenizers` library; Anthropic's documented stream event order.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from tokenizers import Tokenizer

from tests.engine_helpers import make_tiny_model_dir
from tests.model_helpers import mlx_lm_greedy
from tests.server_harness import metric, read_metrics, start_server

KEY = "sk-anthropic-test-key"
SYSTEM = "Be brief."
USER = "What is the capital of France?"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=11)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = [str(tiny[1]), "--served-model-name", "tiny", "--dtype", "float32", "--api-key", KEY]
    s = start_server(args, log)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def oracle(tiny) -> tuple[str, int]:
    """mlx-lm's greedy 8 tokens after the ChatML prompt, and the prompt's token count."""
    model, model_dir = tiny
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{USER}<|im_end|>\n"
    ids = tok.encode(prompt + "<|im_start|>assistant\n").ids
    tokens, _ = mlx_lm_greedy(model, ids, 8)
    return tok.decode(tokens), len(ids)


# Greedy: the SDK no longer has a temperature argument (the API still takes the field).
GREEDY = {"extra_body": {"temperature": 0.0}}


def create(client, **kwargs):
    args = {"model": "tiny", "max_tokens": 8, "system": SYSTEM} | GREEDY
    return client.messages.create(
        **(args | {"messages": [{"role": "user", "content": USER}]} | kwargs)
    )


def test_create_matches_mlx_lm(client, oracle) -> None:
    want, num_prompt = oracle
    msg = create(client)
    assert (msg.type, msg.role, msg.model, msg.stop_reason) == (
        "message",
        "assistant",
        "tiny",
        "max_tokens",
    )
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == want
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (num_prompt, 8)
    blocks = create(
        client,
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": USER}]}],
    )
    assert blocks.content[0].text == want
    # The same prompt again: input_tokens is what the prefix cache did not hold.
    u = blocks.usage
    assert u.cache_read_input_tokens > 0 and u.cache_creation_input_tokens == 0
    assert u.input_tokens + u.cache_read_input_tokens == num_prompt


def test_stop_sequences(client, oracle) -> None:
    want, _ = oracle
    stop = want[-3:]  # text the greedy answer reaches once, at its end
    assert want.count(stop) == 1 and "\ufffd" not in stop
    msg = create(client, stop_sequences=[stop], max_tokens=12)  # stops before the limit
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.content[0].text == want[:-3]


def test_stream_text_final_message_and_event_order(client, server, oracle) -> None:
    want, num_prompt = oracle
    args = {"model": "tiny", "max_tokens": 8, "system": SYSTEM}
    with client.messages.stream(
        messages=[{"role": "user", "content": USER}], **args, **GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want and final.content[0].text == want
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 8)
    body = args | {
        "messages": [{"role": "user", "content": USER}],
        "stream": True,
        "temperature": 0,
    }
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers=headers) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    datas = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert [d["type"] for d in datas] == names  # each event's name is its data's type
    # Anthropic's documented sequence: one text block, deltas, then the message's end.
    n = names.count("content_block_delta")
    assert n >= 1 and names == [
        "message_start", "ping", "content_block_start", *["content_block_delta"] * n,
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    # The same prompt again: its full blocks come from the prefix cache, and Anthropic's
    # input_tokens leaves them out (the prompt is the sum of the three counts).
    start, end = datas[0]["message"]["usage"], datas[-2]["usage"]
    assert start["cache_read_input_tokens"] > 0 and start["cache_creation_input_tokens"] == 0
    assert start["input_tokens"] + start["cache_read_input_tokens"] == num_prompt
    assert {k: end[k] for k in start if k != "output_tokens"} == {
        k: v for k, v in start.items() if k != "output_tokens"
    }
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens"


def test_count_tokens(client, oracle) -> None:
    _, num_prompt = oracle
    count = client.messages.count_tokens(
        model="tiny", system=SYSTEM, messages=[{"role": "user", "content": USER}]
    )
    assert count.input_tokens == num_prompt


def test_errors_in_anthropics_shape(client, server) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, extra_body={"temperature": -1.0})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature must be >= 0" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        create(client, model="nope")
    assert e.value.body["type"] == "error"
    with pytest.raises(anthropic.BadRequestError, match="cannot see images"):
        create(client, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny"}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.body["error"]["type"] == "authentication_error"
    values = read_metrics(server.url)
    assert metric(values, "vllm:kv_cache_usage_perc", model_name="tiny") == 0
