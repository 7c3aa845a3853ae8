"""What coding agents send to /v1/messages, with the official `anthropic` SDK against a real server.

The bodies are written here with the structure of Claude Code's first requests (not its text):
a billing-header-like first system block, a long system text with cache_control, 24 tools with
nested schemas, a system message in the middle of `messages`, adaptive thinking, context
management edits, output_config.effort, metadata, beta headers and `?beta=true`.

The server runs a tiny random model with a Qwen3-like template written here, which shows the
reasoning switches in the prompt: so count_tokens (an exact token count of the rendered prompt,
checked against the `tokenizers` library) tells whether a field changed the prompt.
Every field the SDK's MessageCreateParams lists is classified by `test_every_sdk_field`.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import message_create_params
from anthropic.types.beta import message_create_params as beta_message_create_params
from tokenizers import Tokenizer

from mlxserve.server.anthropic import FIELDS
from tests.engine_helpers import make_tiny_model_dir
from tests.server_harness import start_server

MODEL = "tiny"
# Qwen3-like: reasoning switches in the generation prompt, earlier reasoning rendered, the
# effort in the system turn, and every message (system ones too) in place.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'system' and loop.first and reasoning_effort is defined %}"
    "Effort: {{ reasoning_effort }}\n{% endif %}"
    "{% if m.reasoning_content is defined %}<think>\n{{ m.reasoning_content }}\n</think>\n"
    "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif enable_thinking is defined %}<think>\n{% endif %}{% endif %}"
)
BETAS = ["interleaved-thinking-2025-05-14", "context-management-2025-06-27"]
BILLING = "x-anthropic-billing-header: cc_version=2.1.0; cch=ab12c;"
LONG_SYSTEM = "You are a coding agent working in a git repository. " * 8


def tool_schema(i: int) -> dict:
    """A nested input schema: objects in arrays, enums, anyOf, $defs / $ref, no extra keys."""
    edit = {
        "type": "object",
        "properties": {
            "a": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "r": {"$ref": "#/$defs/r"},
        },
        "required": ["a"],
        "additionalProperties": False,
    }  # fmt: skip
    return {
        "type": "object",
        "$defs": {"r": {"type": "object", "properties": {"n": {"type": "integer"}}}},
        "properties": {
            "path": {"type": "string"},
            "mode": {"enum": ["r", "w"]},
            "edits": {"type": "array", "items": edit},
        },
        "required": ["path"],
        "additionalProperties": False,
    }


TOOLS = [
    {"name": f"tool_{i}", "description": f"Tool {i}.", "input_schema": tool_schema(i)}
    for i in range(21)
]
TOOLS[-1] = TOOLS[-1] | {"cache_control": {"type": "ephemeral"}, "strict": True}
SERVER_TOOLS = [
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
    {"type": "bash_20250124", "name": "bash"},
    {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
]
SYSTEM = [
    {"type": "text", "text": BILLING},
    {"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral"}},
]
CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "I should look around first.", "signature": "sig1"},
            {"type": "tool_use", "id": "toolu_1", "name": "tool_0", "input": {"path": "."}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py\nb.py"},
            {"type": "text", "text": "Now read a.py.", "cache_control": {"type": "ephemeral"}},
        ],
    },
    {"role": "system", "content": "The user prefers short answers."},
]


def agent_body(**changes) -> dict:
    """The keyword arguments of a Claude Code-shaped first request."""
    return {
        "model": MODEL,
        "max_tokens": 16,
        "system": SYSTEM,
        "messages": CONVERSATION,
        "tools": TOOLS + SERVER_TOOLS,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_abc_account_def_session_0123"},
    } | changes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("tiny"), seed=5, max_position_embeddings=16384
    )


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("agents")
    (tmp / "template.jinja").write_text(TEMPLATE)
    args = [str(tiny[1]), "--served-model-name", MODEL, "--dtype", "float32"]
    args += ["--max-model-len", "16384"]
    s = start_server(args + ["--chat-template", str(tmp / "template.jinja")], tmp / "log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny) -> Tokenizer:
    return Tokenizer.from_file(str(tiny[1] / "tokenizer.json"))


def count(client, **body) -> int:
    body = {k: v for k, v in agent_body(**body).items() if k not in ("max_tokens", "metadata")}
    return client.beta.messages.count_tokens(**body, betas=BETAS).input_tokens


def test_claude_code_shaped_requests_stream_and_answer(client, server) -> None:
    body = agent_body()
    msg = client.beta.messages.create(**body, betas=BETAS)
    assert msg.type == "message" and msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert msg.context_management.applied_edits[0].type == "clear_thinking_20251015"
    # adaptive thinking opened <think> in the prompt: the reply starts as reasoning
    assert msg.content[0].type == "thinking" and msg.content[0].signature
    with client.beta.messages.stream(**body, betas=BETAS) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].type == "thinking" and final.content[0].thinking
    assert final.content[0].signature  # a signature_delta closed the thinking block
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in deltas and "signature_delta" in deltas
    # What Claude Code's HTTP client sends: ?beta=true and the headers, raw.
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": ",".join(BETAS)}
    url = server.url + "/v1/messages?beta=true"
    r = httpx.post(url, json=agent_body(stream=True), headers=headers, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [ln[7:] for ln in r.text.splitlines() if ln.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    r = httpx.post(server.url + "/v1/messages/count_tokens?beta=true", headers=headers, json={
        k: v for k, v in agent_body().items() if k != "max_tokens"
    })  # fmt: skip
    assert r.status_code == 200 and r.json()["input_tokens"] > 1000, r.text


def test_usage_leaves_cached_tokens_out_of_input_tokens(client) -> None:
    body = agent_body(thinking={"type": "disabled"})
    prompt = count(client, thinking={"type": "disabled"})
    client.beta.messages.create(**body, betas=BETAS)
    again = client.beta.messages.create(**body, betas=BETAS).usage
    assert again.cache_read_input_tokens > prompt // 2 and again.cache_creation_input_tokens == 0
    assert again.input_tokens + again.cache_read_input_tokens == prompt


def test_a_session_hits_the_cache_though_the_hash_and_budget_change_each_turn(
    client, hf_tokenizer
) -> None:
    """Claude Code recomputes the billing header's cch and the token budget in its system
    prompt on every request: both sit before the whole conversation, and every later turn
    would recompute it all. Neutralized by default (--prompt-normalization)."""
    # The header leaves, and only the header: the same prompt as without its block (the
    # API joins system blocks with no separator, so the next block's text shares its line).
    without = [block for block in SYSTEM if block["text"] != BILLING]
    assert count(client) == count(client, system=without)
    messages: list[dict] = [{"role": "user", "content": "List the files."}]
    previous = 0
    for turn in range(3):
        budget = f"<total_tokens>{90_000 - 1_000 * turn} tokens left</total_tokens>"
        system = [
            {"type": "text", "text": BILLING.replace("ab12c", f"{turn:05x}")},
            {"type": "text", "text": f"{LONG_SYSTEM}\n{budget}"},
        ]
        body = agent_body(system=system, messages=messages, thinking={"type": "disabled"})
        usage = client.beta.messages.create(**(body | {"max_tokens": 2}), betas=BETAS).usage
        if turn:  # all but the previous prompt's end from its moved budget on, and a block
            end = f"\n{budget}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
            tail = len(hf_tokenizer.encode(end).ids)
            assert usage.cache_read_input_tokens >= previous - tail - 16, (turn, usage)
        previous = usage.input_tokens + usage.cache_read_input_tokens
        call = {"type": "tool_use", "id": f"toolu_{turn}", "name": "tool_0", "input": {"path": "."}}
        result = {"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": f"{budget}"}
        messages += [
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result, {"type": "text", "text": f"Turn {turn}."}]},
            {"role": "system", "content": f"Reminder {turn}."},
        ]


def test_mid_conversation_system_message_is_rendered_in_place(client, hf_tokenizer) -> None:
    plain = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be terse."}]
    args = {"model": MODEL, "messages": plain}
    n = client.messages.count_tokens(**args).input_tokens
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>system\nBe terse.<|im_end|>\n"
    assert n == len(hf_tokenizer.encode(prompt + "<|im_start|>assistant\n").ids)
    # clear_at next_user_message: shown only until a later user turn
    later = [*plain, {"role": "assistant", "content": "Ok"}, {"role": "user", "content": "x"}]
    later[1] = later[1] | {"clear_at": "next_user_message"}
    shown = [{k: v for k, v in m.items() if k != "clear_at"} for m in later]
    dropped = [later[0], *later[2:]]
    counts = [
        client.messages.count_tokens(model=MODEL, messages=m).input_tokens
        for m in (later, shown, dropped)
    ]
    assert counts[0] == counts[2] < counts[1]


def test_thinking_and_effort_switch_the_template(client, hf_tokenizer) -> None:
    def num(text: str) -> int:
        return len(hf_tokenizer.encode(text).ids)

    base = count(client, thinking={"type": "adaptive"}, output_config={"effort": "high"})
    off = count(client, thinking={"type": "disabled"}, output_config={"effort": "high"})
    assert off - base == num("<think>\n\n</think>\n\n") - num("<think>\n")
    low = count(client, thinking={"type": "adaptive"}, output_config={"effort": "low"})
    assert num("Effort: high") - num("Effort: low") == base - low
    enabled = count(client, thinking={"type": "enabled", "budget_tokens": 2048})
    assert enabled == base


def test_context_management_clears_earlier_thinking(client, hf_tokenizer) -> None:
    reasoning = "I should look around first."
    keep_all = count(client)
    cleared = client.beta.messages.count_tokens(
        **{k: v for k, v in agent_body().items() if k not in ("max_tokens", "metadata")}
        | {"context_management": {"edits": [{"type": "clear_thinking_20251015"}]}},
        betas=BETAS,
    )
    # keep defaults to the last turn with thinking; there is one: nothing cleared
    assert cleared.input_tokens == keep_all
    edit = {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}
    msg = client.beta.messages.create(
        **agent_body(context_management={"edits": [edit]}), betas=BETAS
    )
    applied = msg.context_management.applied_edits[0]
    assert applied.cleared_thinking_turns == 1
    assert applied.cleared_input_tokens == len(hf_tokenizer.encode(reasoning).ids)
    none_kept = count(client, context_management={"edits": [edit]})
    assert keep_all - none_kept >= len(hf_tokenizer.encode(reasoning).ids)


def test_clear_tool_uses_replaces_old_results(client, hf_tokenizer) -> None:
    results = "\n".join(f"line {i}" for i in range(200))
    turns = [{"role": "user", "content": "Go."}]
    for i in range(4):
        call = {"type": "tool_use", "id": f"toolu_{i}", "name": "tool_1", "input": {"path": "x"}}
        result = {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": results}
        turns += [{"role": "assistant", "content": [call]}, {"role": "user", "content": [result]}]
    edit = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "tool_uses", "value": 2},
        "keep": {"type": "tool_uses", "value": 1},
    }
    args = {"model": MODEL, "messages": turns, "tools": TOOLS[:2], "betas": BETAS}
    full = client.beta.messages.count_tokens(**args)
    edited = client.beta.messages.count_tokens(**args, context_management={"edits": [edit]})
    assert edited.context_management.original_input_tokens == full.input_tokens
    # three of the four results cleared
    assert full.input_tokens - edited.input_tokens > 2.5 * len(hf_tokenizer.encode(results).ids)
    msg = client.beta.messages.create(**args, max_tokens=2, context_management={"edits": [edit]})
    assert msg.context_management.applied_edits[0].cleared_tool_uses == 3


def test_output_config_format_is_structured_output(client) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    msg = client.messages.create(
        model=MODEL,
        max_tokens=400,
        messages=[{"role": "user", "content": "Where?"}],
        thinking={"type": "disabled"},  # else the constraint starts after the reasoning
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(msg.content[0].text), schema)


def test_tool_choice_in_anthropics_words(client) -> None:
    base = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**base, tool_choice={"type": "any"})
    assert "'any'" in e.value.message and "required" not in e.value.message
    with pytest.raises(anthropic.BadRequestError, match="server tool"):
        client.messages.create(
            **base, tools=SERVER_TOOLS, tool_choice={"type": "tool", "name": "bash"}
        )
    with pytest.raises(anthropic.BadRequestError, match="Input tag 'required'"):
        client.messages.create(**base, tools=TOOLS[:1], tool_choice={"type": "required"})
    # (a schema without $defs: forced-call grammars of $ref schemas are another issue's)
    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    plain = {"name": "read", "input_schema": schema}
    forced = client.messages.create(
        **base | {"max_tokens": 60}, tools=[plain, *TOOLS[:1], *SERVER_TOOLS],
        tool_choice={"type": "tool", "name": "read", "disable_parallel_tool_use": True},
    )  # fmt: skip
    calls = [b for b in forced.content if b.type == "tool_use"]
    assert len(calls) <= 1 and all(c.name == "read" for c in calls)
    none = client.messages.create(**base, tools=TOOLS[:2], tool_choice={"type": "none"})
    assert all(b.type != "tool_use" for b in none.content)


def test_refused_content_and_roles_in_anthropics_shape(client) -> None:
    base = {"model": MODEL, "max_tokens": 4}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**base, messages=[{"role": "user", "content": [image]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0" in e.value.message and "image" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**base, messages=[{"role": "tool", "content": "x"}])
    # Claude Code's fallback matches these words (its retry drops system messages)
    assert "Unexpected role" in e.value.message and "input message role" in e.value.message
    with pytest.raises(anthropic.BadRequestError, match="nonsense: Extra inputs are not permitted"):
        client.messages.create(**base, messages=CONVERSATION[:1], extra_body={"nonsense": 1})


def sdk_fields(params: type) -> set[str]:
    return set(params.__required_keys__ | params.__optional_keys__)


SDK_FIELDS = sorted(
    sdk_fields(message_create_params.MessageCreateParamsStreaming)
    | sdk_fields(beta_message_create_params.MessageCreateParamsStreaming)
)
# A value a client would send for each field the server accepts without using it.
ACCEPTED_VALUES = {
    "metadata": {"user_id": "u1"},
    "service_tier": "auto",
    "container": "container_1",
    "cache_control": {"type": "ephemeral"},
    "diagnostics": {"previous_message_id": "msg_1"},
    "inference_geo": "us",
    "speed": "fast",
    "betas": ["context-management-2025-06-27"],
    "user_profile_id": "up_1",
    "workspace_id": "wrkspc_1",
    "mcp_servers": [{"type": "url", "url": "https://example.invalid/mcp", "name": "docs"}],
    "billing_policy": {"type": "default"},
    "fallback_credit_token": "tok_1",
    "fallbacks": [{"model": "other"}],
    "compaction": {"type": "enabled"},
}
REFUSED_VALUES = {"thread": {"type": "continue", "previous_message_id": "msg_1"}}


@pytest.mark.parametrize("name", SDK_FIELDS)
def test_every_sdk_field(server, name: str) -> None:
    """Each field of the SDK's MessageCreateParams is honoured (tested above), accepted (200
    with a real value) or refused (400 naming it); a new SDK field fails here until classified."""
    assert name in FIELDS, f"{name}: classify it in mlxserve.server.anthropic.FIELDS"
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    if FIELDS[name] == "honoured":
        return  # each has its own test in this file or test_server_anthropic.py
    value = ACCEPTED_VALUES[name] if FIELDS[name] == "accepted" else REFUSED_VALUES[name]
    r = httpx.post(server.url + "/v1/messages", json=body | {name: value}, timeout=60)
    if FIELDS[name] == "accepted":
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(name)
