"""The HTTP API on a tiny random model: errors, auth, tokenize, logprobs, n, stop, echo.

One real `mlxserve serve` subprocess for the module. Oracles: mlx-lm running the same
weights (logprobs, greedy tokens) and the `tokenizers` library reading the same
tokenizer.json (token ids, text).
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.engine_helpers import make_tiny_model_dir
from tests.model_helpers import mlx_lm_greedy
from tests.server_harness import assert_openai_error, start_server, stream_events

KEY = "sk-tiny-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=5)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory: pytest.TempPathFactory):
    _, model_dir = tiny
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = [str(model_dir), "--api-key", KEY, "--max-model-len", str(MAX_MODEL_LEN)]
    s = start_server(args + ["--served-model-name", "tiny", "tiny-alias"], log)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def hf_tok(tiny) -> Tokenizer:
    return Tokenizer.from_file(str(tiny[1] / "tokenizer.json"))


def chatml(messages: list[dict]) -> str:
    """The tiny model's ChatML template, written out by hand."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def completion(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------------ errors
def engine_param(field: str) -> tuple[str | None, ...]:
    """The param of an engine rejection: the engine raises ParameterError naming it. The
    mapping itself is tested exactly in tests/test_server_failure.py with injected errors."""
    return (field,)


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": [1, 2, 999999]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    (
        "/v1/completions",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        "stream_options",
    ),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{}]},
        "tools.0.type",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "xml"},
        },
        "response_format.type",
    ),
    (  # add_generation_prompt is true unless set false
        "/v1/chat/completions",
        {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
        "continue_final_message",
    ),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS)
def test_invalid_parameters_are_400_naming_the_field(http, path, body, param) -> None:
    # A streamed request fails before any event, as plain JSON.
    for stream in (False,) if "stream_options" in body else (False, True):
        err = assert_openai_error(http.post(path, json=body | {"stream": stream}), 400, param)
        assert err["type"] == "invalid_request_error"
        assert param.split(".")[0] in err["message"]


def test_unsupported_fields_are_named(http) -> None:
    body = {"model": "tiny", "prompt": "hi", "suffix": "!", "tools": [{}]}
    err = assert_openai_error(http.post("/v1/completions", json=body), 400)
    assert "'suffix'" in err["message"] and "'tools'" in err["message"]
    assert "unsupported" in err["message"]


def test_null_and_empty_unsupported_fields_count_as_absent(http) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    for extra in ({"tools": []}, {"tools": None, "functions": []}, {"temperature": None}):
        r = http.post("/v1/chat/completions", json=body | extra)
        assert r.status_code == 200, (extra, r.text)
    err = assert_openai_error(
        http.post("/v1/chat/completions", json=body | {"tools": [{"type": "function"}]}), 400
    )
    assert err["param"] == "tools.0.function"


def test_malformed_json_and_non_object_bodies_are_400(http) -> None:
    for raw in (b'{"prompt": "hi", ', b"[1, 2]", b"\xff\xfe", b""):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            assert_openai_error(http.post(path, content=raw), 400)


def test_prompt_longer_than_max_model_len_is_400_with_the_numbers(http) -> None:
    ids = list(range(10, 10 + MAX_MODEL_LEN + 6))
    for stream in (False, True):
        err = assert_openai_error(
            http.post("/v1/completions", json={"prompt": ids, "stream": stream}), 400
        )
        assert err["param"] in engine_param("prompt")
        assert str(len(ids)) in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    long_chat = {"messages": [{"role": "user", "content": "Paris " * 200}]}
    err = assert_openai_error(http.post("/v1/chat/completions", json=long_chat), 400)
    assert err["param"] in engine_param("messages")
    assert str(MAX_MODEL_LEN) in err["message"]


def test_max_tokens_beyond_max_model_len_is_400_with_the_numbers(http) -> None:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": MAX_MODEL_LEN}
    err = assert_openai_error(http.post("/v1/completions", json=body), 400)
    assert err["param"] in engine_param("max_tokens")
    assert (
        f"max_tokens {MAX_MODEL_LEN}" in err["message"]
        and f"= {4 + MAX_MODEL_LEN}" in err["message"]
    )


def test_api_key_is_required_and_checked(server) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            r = httpx.request(method, server.url + path, json=body, headers=headers)
            err = assert_openai_error(r, 401)
            assert err["code"] == "invalid_api_key"
        assert_openai_error(httpx.post(server.url + "/tokenize", json={"prompt": "a"}), 401)
    # Load balancers and Prometheus need no key.
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200
    assert httpx.get(server.url + "/version").json() == {"version": "0.1.0"}


def test_unknown_model_and_route_are_404(http) -> None:
    err = assert_openai_error(
        http.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404, "model"
    )
    assert err["code"] == "model_not_found" and "gpt-4" in err["message"]
    chat = {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}
    assert_openai_error(http.post("/v1/chat/completions", json=chat), 404, "model")
    assert_openai_error(http.get("/v1/models/gpt-4"), 404, "model")
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


def test_server_keeps_serving_after_errors(http) -> None:
    for path, body, _ in BAD_REQUESTS[:5]:
        http.post(path, json=body)
    http.post("/v1/completions", content=b"{oops")
    out = completion(http, prompt=[5, 6, 7], max_tokens=2, temperature=0)
    assert out["usage"]["completion_tokens"] == 2


# --------------------------------------------------------------------- endpoints
def test_models_lists_every_served_name(http, tiny) -> None:
    data = http.get("/v1/models").json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == ["tiny", "tiny-alias"]
    card = http.get("/v1/models/tiny-alias").json()
    assert card["id"] == "tiny-alias" and card["object"] == "model"
    assert card["max_model_len"] == MAX_MODEL_LEN
    # root: the model's name as given (here a directory: its name), never a local path.
    model_dir = tiny[1]
    assert {m["root"] for m in data["data"]} == {card["root"]} == {model_dir.name}
    assert str(model_dir.parent) not in http.get("/v1/models").text
    # Either name works; no name means the first.
    for name in ("tiny-alias", None):
        body = {"prompt": [5, 6], "max_tokens": 1} | ({"model": name} if name else {})
        r = http.post("/v1/completions", json=body)
        assert r.json()["model"] == (name or "tiny")


def test_tokenize_and_detokenize_match_the_tokenizers_library(http, hf_tok) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    want = hf_tok.encode(text).ids
    got = http.post("/tokenize", json={"prompt": text}).json()
    assert got == {"count": len(want), "max_model_len": MAX_MODEL_LEN, "tokens": want}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    got = http.post("/tokenize", json={"messages": messages}).json()
    assert got["tokens"] == hf_tok.encode(chatml(messages)).ids
    assert http.post("/detokenize", json={"tokens": want}).json() == {"prompt": text}
    assert_openai_error(http.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    assert_openai_error(http.post("/tokenize", json={}), 400)


def _log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    return row - row.max() - np.log(np.exp(row - row.max()).sum())


def test_completion_logprobs_match_mlx_lm(http, tiny, hf_tok) -> None:
    oracle, _ = tiny
    prompt = [12, 40, 77, 301, 9]
    tokens, logits = mlx_lm_greedy(oracle, prompt, 4)
    out = completion(http, prompt=prompt, max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    choice = out["choices"][0]
    assert choice["text"] == hf_tok.decode(tokens)
    lp = choice["logprobs"]
    assert lp["tokens"] == [hf_tok.decode([t]) for t in tokens]
    offsets = np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]).tolist()
    assert lp["text_offset"] == offsets
    for i, row in enumerate(logits):
        want = _log_softmax(row)
        assert lp["token_logprobs"][i] == pytest.approx(want[tokens[i]], abs=1e-3)
        top3 = np.argsort(-want)[:3]
        got = lp["top_logprobs"][i]
        assert sorted(got.values()) == pytest.approx(sorted(want[top3]), abs=1e-3)
        assert set(got) == {hf_tok.decode([int(t)]) for t in top3}
    assert out["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 4,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_echo_with_logprobs_includes_the_prompt(http, tiny, hf_tok) -> None:
    oracle, _ = tiny
    prompt = [12, 40, 77]
    tokens, _ = mlx_lm_greedy(oracle, prompt, 2)
    out = completion(http, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=0)
    choice = out["choices"][0]
    assert choice["text"] == hf_tok.decode(prompt) + hf_tok.decode(tokens)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 5 and lp["token_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    events = stream_events(
        http,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 0},
    )
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    streamed = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]


def test_chat_logprobs_match_mlx_lm(http, tiny, hf_tok) -> None:
    oracle, _ = tiny
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tokens, logits = mlx_lm_greedy(oracle, hf_tok.encode(chatml(messages)).ids, 3)
    body = {
        "model": "tiny",
        "messages": messages,
        "max_completion_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
    }
    out = http.post("/v1/chat/completions", json=body).json()
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": hf_tok.decode(tokens)}
    content = choice["logprobs"]["content"]
    for entry, tok, row in zip(content, tokens, logits, strict=True):
        want = _log_softmax(row)
        assert entry["token"] == hf_tok.decode([tok])
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["logprob"] == pytest.approx(want[tok], abs=1e-3)
        top2 = np.argsort(-want)[:2]
        assert [t["token"] for t in entry["top_logprobs"]] == [
            hf_tok.decode([int(t)]) for t in top2
        ]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(want[top2], abs=1e-3)
    events = stream_events(http, "/v1/chat/completions", body)
    streamed = [
        x for e in events[1:] for x in (e["choices"][0]["logprobs"] or {}).get("content", [])
    ]
    assert [x["token"] for x in streamed] == [x["token"] for x in content]


def test_multiple_prompts_and_n_samples(http) -> None:
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    body = {"prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 7}
    out = completion(http, **body, ignore_eos=True)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == 7 and out["usage"]["completion_tokens"] == 12
    # Seeded sampling: the stream carries the same texts, chunk by chunk.
    events = stream_events(http, "/v1/completions", body | {"ignore_eos": True})
    texts = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {c["index"]: c["text"] for c in out["choices"]}
    finals = [c for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finals) == [0, 1, 2, 3]


def test_stop_strings_cut_the_text(http) -> None:
    prompt = [30, 31, 32, 33]
    full = completion(http, prompt=prompt, max_tokens=10, temperature=0, ignore_eos=True)
    text = full["choices"][0]["text"]
    stop = next(
        text[i : i + 2]
        for i in range(2, len(text) - 2)
        if text[i : i + 2].strip() == text[i : i + 2]
    )
    cut = text[: text.index(stop)]
    body = {
        "prompt": prompt,
        "max_tokens": 10,
        "temperature": 0,
        "stop": [stop],
        "ignore_eos": True,
    }
    out = completion(http, **body)["choices"][0]
    assert (out["text"], out["finish_reason"], out["stop_reason"]) == (cut, "stop", stop)
    events = stream_events(http, "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events) == cut
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_accepts_text_parts_and_every_role(http, hf_tok) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "user", "content": "and?"},
    ]
    body = {"messages": messages, "max_tokens": 1, "temperature": 0}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    flat = [m | {"content": "a\nb"} if isinstance(m["content"], list) else m for m in messages]
    assert out["usage"]["prompt_tokens"] == len(hf_tok.encode(chatml(flat)).ids)


def test_continue_final_message_continues_the_prefilled_reply(http, hf_tok) -> None:
    prefill = "```python\nx = 1\n"  # trailing newline kept: the template renders it verbatim
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Code?"},
        {"role": "assistant", "content": prefill},
    ]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    by_hand = chatml(messages[:2]) + prefill  # the final turn left open
    got = http.post("/tokenize", json={"messages": messages, **flags}).json()
    assert got["tokens"] == hf_tok.encode(by_hand).ids
    body = {"messages": messages, "max_tokens": 3, "temperature": 0, **flags}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["prompt_tokens"] == len(hf_tok.encode(by_hand).ids)
    # The reply holds only the continuation, as the same prompt through /v1/completions.
    plain = completion(http, prompt=by_hand, max_tokens=3, temperature=0)
    assert out["choices"][0]["message"]["content"] == plain["choices"][0]["text"]


def test_cors_is_off_by_default(http) -> None:
    r = http.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
