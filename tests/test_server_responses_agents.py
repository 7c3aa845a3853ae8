"""Coding-agent traffic on /v1/responses and /v1/chat/completions (tiny model, real server).

The bodies have the structure of Codex's first requests and follow-up turns (written here,
no client and no prompt text of theirs): long instructions, developer messages before and in
the middle of the conversation, reasoning with a summary and encrypted_content, a prompt
cache key, client metadata, store false, streaming, 20+ tools with nested schemas, a
namespace group, server tools, a freeform custom tool and local_shell.

The model's chat template keeps reasoning (``<think>``, as Qwen3's) and has the
``enable_thinking`` switch. Oracles: the openai SDK's own event and item types (every event
validates against ``ResponseStreamEvent``), mlx-lm's greedy tokens for the same weights on
prompts rendered by hand and tokenized by the ``tokenizers`` library, jsonschema for call
arguments, ``re`` for a custom tool's regex grammar.
"""

from __future__ import annotations

import json
from typing import get_args

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.responses import ResponseStreamEvent
from tokenizers import Tokenizer

from tests.engine_helpers import make_tiny_model_dir
from tests.model_helpers import mlx_lm_greedy
from tests.paths import ROOT
from tests.server_harness import assert_openai_error, start_server

N = 6
# ChatML that keeps reasoning and opens <think> unless enable_thinking is false (Qwen3's way).
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n"
    "{% endif %}{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
# The SDK's event class for each event type (ResponseStreamEvent is a union on "type").
EVENTS = {
    get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in get_args(get_args(ResponseStreamEvent)[0])
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    model, model_dir = make_tiny_model_dir(
        tmp_path_factory.mktemp("tiny"), seed=13, max_position_embeddings=16384
    )
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"chat_template": THINKING}))
    return model, model_dir


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    s = start_server([str(tiny[1]), "--served-model-name", "tiny", "--dtype", "float32"], log)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf_tok(tiny) -> Tokenizer:
    return Tokenizer.from_file(str(tiny[1] / "tokenizer.json"))


def render(turns: list[tuple[str, str, str]], thinking: bool = True) -> str:
    """THINKING rendered by hand: (role, reasoning, content) turns, then the reply's start."""
    text = ""
    for role, reasoning, content in turns:
        think = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
        text += f"<|im_start|>{role}\n{think}{content}<|im_end|>\n"
    return (
        text + "<|im_start|>assistant\n" + ("<think>\n" if thinking else "<think>\n\n</think>\n\n")
    )


def greedy(tiny, hf_tok: Tokenizer, prompt: str) -> tuple[str, int]:
    """mlx-lm's greedy reply (up to N tokens, cut at <|im_end|>) and the prompt's length."""
    ids = hf_tok.encode(prompt).ids
    tokens, _ = mlx_lm_greedy(tiny[0], ids, N)
    eos = hf_tok.token_to_id("<|im_end|>")
    if eos in tokens:
        tokens = tokens[: tokens.index(eos)]
    return hf_tok.decode(tokens), len(ids)


# --------------------------------------------------------------------- Codex-shaped bodies
INSTRUCTIONS = "You are a coding agent working in a repository. " * 8
NESTED = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "options": {
            "type": "object",
            "properties": {
                "recursive": {"type": "boolean"},
                "depth": {"type": "integer", "minimum": 0},
                "filters": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"glob": {"type": "string"}, "exclude": {"type": "boolean"}},
                        "required": ["glob"],
                    },
                },
            },
        },
        "mode": {"anyOf": [{"type": "string", "enum": ["fast", "full"]}, {"type": "null"}]},
    },
    "required": ["path"],
    "additionalProperties": False,
}
READ_SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string", "maxLength": 8}},
    "required": ["path"],
    "additionalProperties": False,
}
PATCH_REGEX = "[a-z]{1,6}"


SMALL = {
    "type": "object",
    "properties": {"q": {"type": "object", "properties": {"n": {"type": "integer"}}}},
}


def agent_tools() -> list[dict]:
    functions = [
        {
            "type": "function",
            "name": f"tool_{i}",
            "description": f"Tool {i}.",
            "strict": False,
            "parameters": NESTED if i % 10 == 0 else SMALL,
        }
        for i in range(20)
    ]
    namespace = {
        "type": "namespace",
        "name": "mcp__fs__",
        "description": "A file system server.",
        "tools": [
            {"type": "function", "name": "read", "description": "Read a file.", "strict": True,
             "parameters": READ_SCHEMA},
            {"type": "function", "name": "list", "description": "List a directory.",
             "strict": False, "parameters": NESTED},
        ],
    }  # fmt: skip
    custom = {
        "type": "custom",
        "name": "apply_patch",
        "description": "Apply a patch to the workspace.",
        "format": {"type": "grammar", "syntax": "regex", "definition": PATCH_REGEX},
    }
    freeform = {"type": "custom", "name": "note", "description": "Write a free-form note."}
    return functions + [namespace, custom, freeform, {"type": "local_shell"},
                        {"type": "web_search", "external_web_access": False}]  # fmt: skip


def first_turn_input() -> list[dict]:
    return [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions>sandboxed</permissions>"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "<environment_context><cwd>/repo</cwd>"
                      "<shell>bash</shell></environment_context>"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Add a test for the parser."}]},
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<collaboration_mode>default"
                      "</collaboration_mode>"}]},
    ]  # fmt: skip


def codex_body(input_items: list[dict], **more) -> dict:
    return {
        "model": "tiny",
        "instructions": INSTRUCTIONS,
        "input": input_items,
        "tools": agent_tools(),
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
        "text": {"verbosity": "low"},
        "temperature": 0,
        "max_output_tokens": N,
    } | more


def stream(http: httpx.Client, body: dict) -> list[dict]:
    """A Responses stream's events, each validated against the SDK's event types."""
    events = []
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200, r.read().decode()
        assert r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: ") :])
                assert event["type"] == kind
                EVENTS[kind].model_validate(event)
                events.append(event)
    return events


def check_well_formed(events: list[dict]) -> dict:
    """Sequence numbers, item open/close pairs, one terminal event: the final response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = {
        e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.done"
    }
    assert added == sorted(done) == list(range(len(added)))
    final = events[-1]["response"]
    assert final["output"] == [done[i] for i in added]
    return final


def test_codex_shaped_turns_stream_well_formed(server, tiny, hf_tok) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        body = codex_body(first_turn_input(), client_metadata={"x-codex-turn": "1"})
        first = check_well_formed(stream(http, body))
        (reasoning,) = [item for item in first["output"] if item["type"] == "reasoning"]
        text = reasoning["content"][0]["text"]
        assert text and reasoning["summary"] == [{"type": "summary_text", "text": text}]
        assert first["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
        assert "dropped" not in server.log() and "left out" in server.log()  # web_search
        # The follow-up turn sends back the reasoning (encrypted_content), calls of every kind
        # the tools allow (a namespaced function, a custom tool, local_shell) and their outputs.
        history = first_turn_input() + [
            reasoning,
            {"type": "function_call", "call_id": "c1", "name": "read", "namespace": "mcp__fs__",
             "arguments": '{"path": "a.py"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "print('hi')"},
            {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "abc"},
            {"type": "custom_tool_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "Done."}]},
            {"type": "local_shell_call", "id": "ls1", "call_id": "c3", "status": "completed",
             "action": {"type": "exec", "command": ["ls"], "env": {}}},
            {"type": "local_shell_call_output", "id": "c3", "output": "a.py"},
            {"type": "web_search_call", "id": "ws1", "status": "completed",
             "action": {"type": "search", "query": "parser"}},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Tests pass.", "annotations": []}]},
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "<turn_aborted/>"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Go on."}]},
        ]  # fmt: skip
        second = check_well_formed(stream(http, codex_body(history)))
        prompt = first["usage"]["input_tokens"]
        assert second["usage"]["input_tokens"] > prompt
        # The session's next turn computes only what it added: the first turn's prompt (up to
        # its last partial block) comes from the prefix cache.
        assert second["usage"]["input_tokens_details"]["cached_tokens"] >= prompt - 32


def test_reasoning_items_round_trip_and_system_turns_stay_in_place(client, tiny, hf_tok) -> None:
    first = client.responses.create(
        model="tiny", input="Hi", temperature=0, max_output_tokens=N,
        reasoning={"effort": "high"}, include=["reasoning.encrypted_content"], store=False,
    )  # fmt: skip
    want, _ = greedy(tiny, hf_tok, render([("user", "", "Hi")]))
    (item,) = first.output
    assert item.type == "reasoning" and item.summary == []  # no summary asked for
    assert item.content[0].text == want.strip() and item.encrypted_content
    # Sent back, the reasoning renders in the assistant turn it preceded; developer and system
    # items render where they are; instructions first.
    items = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": "Hi"},
        item.model_dump(exclude_none=True) | {"content": None, "summary": []},
        {"type": "message", "role": "assistant", "content": "Hello"},
        {"type": "message", "role": "system", "content": "Mid note."},
        {"type": "message", "role": "user", "content": "More"},
    ]
    items[2].pop("content")
    second = client.responses.create(
        model="tiny", input=items, instructions="Sys", temperature=0, max_output_tokens=N
    )
    prompt = render(
        [("system", "", "Sys"), ("system", "", "Be brief."), ("user", "", "Hi"),
         ("assistant", want.strip(), "Hello"), ("system", "", "Mid note."), ("user", "", "More")]
    )  # fmt: skip
    want2, num_prompt = greedy(tiny, hf_tok, prompt)
    assert second.usage.input_tokens == num_prompt
    assert second.output[0].content[0].text == want2.strip()
    count = client.responses.input_tokens.count(model="tiny", input=items, instructions="Sys")
    assert count.input_tokens == num_prompt


def test_reasoning_effort_is_the_templates_switch(client, server, tiny, hf_tok) -> None:
    off = client.responses.create(
        model="tiny", input="Hi", temperature=0, max_output_tokens=N, reasoning={"effort": "none"}
    )
    want, num_prompt = greedy(tiny, hf_tok, render([("user", "", "Hi")], thinking=False))
    assert [o.type for o in off.output] == ["message"] and off.output_text == want
    assert off.usage.input_tokens == num_prompt
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=N,
        reasoning_effort="minimal",
    )  # fmt: skip
    assert chat.choices[0].message.content == want and chat.usage.prompt_tokens == num_prompt
    on = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=N,
        reasoning_effort="low",
    )  # fmt: skip
    want_on, _ = greedy(tiny, hf_tok, render([("user", "", "Hi")]))
    assert on.choices[0].message.reasoning_content == want_on.strip()
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="Hi", reasoning={"effort": "extreme"})
    assert e.value.body["param"] == "reasoning.effort"


def test_stored_responses_are_deleted_listed_and_referenced(client, server) -> None:
    first = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    items = client.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].role == "user"
    ref = {"type": "item_reference", "id": first.output[0].id}
    second = client.responses.create(
        model="tiny", input=[ref, {"role": "user", "content": "And?"}], max_output_tokens=2
    )
    assert second.status in ("completed", "incomplete")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/responses", json={"model": "tiny", "input": [ref | {"id": "nope"}]})
        assert_openai_error(r, 404, "input.0.id")
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


# ------------------------------------------------------------------- field policy, per field
# Every top-level field the installed openai SDK lists, with an example value and what the
# server does with it: honoured (the file whose tests check the effect), accepted (200, no
# effect on the output) or refused (400 naming the field). A field a newer SDK adds fails
# test_every_sdk_field_is_classified until it is classified here and in docs/api-fields.md.
PREV = "<a stored response id>"
RESPONSES_FIELDS: dict[str, tuple[str, object]] = {
    "input": ("honoured test_server_responses.py", "Hi"),
    "model": ("honoured test_server_api.py", "tiny"),
    "instructions": ("honoured test_server_responses_agents.py", "Be brief."),
    "previous_response_id": ("honoured test_server_responses.py", PREV),
    "max_output_tokens": ("honoured test_server_responses.py", 2),
    "temperature": ("honoured test_server_responses.py", 0),
    "top_p": ("honoured test_sampler.py", 0.5),
    "text": (
        "honoured test_server_agent_apis.py",
        {"format": {"type": "text"}, "verbosity": "low"},
    ),
    "reasoning": ("honoured test_server_responses_agents.py", {"effort": "low", "summary": "auto"}),
    "include": ("honoured test_server_responses_agents.py", ["reasoning.encrypted_content"]),
    "tools": ("honoured test_server_agent_apis.py", [{"type": "web_search"}]),
    "tool_choice": ("honoured test_server_agent_apis.py", "auto"),
    "parallel_tool_calls": ("honoured test_chat_tools.py", False),
    "store": ("honoured test_server_responses.py", False),
    "stream": ("honoured test_server_responses.py", False),
    "truncation": ("accepted", "auto"),  # too long an input is a 400 either way
    "top_logprobs": ("accepted", 3),  # logprobs come only with include, which is refused
    "max_tool_calls": ("accepted", 4),  # counts server-side tool calls: none run here
    "stream_options": ("accepted", {"include_obfuscation": False}),
    "metadata": ("accepted", {"k": "v"}),
    "user": ("accepted", "u-1"),
    "safety_identifier": ("accepted", "h-1"),
    "service_tier": ("accepted", "priority"),
    "prompt_cache_key": ("accepted", "session-1"),
    "prompt_cache_options": ("accepted", {"mode": "implicit", "ttl": "30m"}),
    "prompt_cache_retention": ("accepted", "24h"),
    "context_management": ("accepted", [{"type": "compaction", "compact_threshold": 9000}]),
    "access_programs": ("accepted", {"cyber": "standard"}),
    "image": ("accepted", {"context_compression": "auto"}),
    "background_options": ("accepted", {"completion_window": "soonest"}),
    "background": ("refused", True),
    "conversation": ("refused", "conv_123"),
    "prompt": ("refused", {"id": "pmpt_123"}),
    "moderation": ("refused", {"model": "omni-moderation-latest"}),
}
# Not in the SDK, sent by real clients: Codex's client_metadata.
RESPONSES_EXTRA = {"client_metadata": ("accepted", {"x-codex-installation-id": "1"})}

CHAT_FIELDS: dict[str, tuple[str, object]] = {
    "messages": ("honoured test_server_api.py", [{"role": "user", "content": "Hi"}]),
    "model": ("honoured test_server_api.py", "tiny"),
    "temperature": ("honoured test_server_openai.py", 0),
    "top_p": ("honoured test_sampler.py", 0.5),
    "n": ("honoured test_server_api.py", 2),
    "seed": ("honoured test_server_api.py", 7),
    "stop": ("honoured test_server_api.py", ["\n\n"]),
    "max_tokens": ("honoured test_server_api.py", 2),
    "max_completion_tokens": ("honoured test_server_api.py", 2),
    "presence_penalty": ("honoured test_sampler.py", 0.5),
    "frequency_penalty": ("honoured test_sampler.py", 0.5),
    "logit_bias": ("honoured test_server_api.py", {"5": 1}),
    "logprobs": ("honoured test_server_api.py", True),
    "top_logprobs": ("honoured test_server_api.py", None),  # with logprobs, below
    "response_format": ("honoured test_server_structured.py", {"type": "json_object"}),
    "tools": (
        "honoured test_chat_tools.py",
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    ),
    "tool_choice": ("honoured test_chat_tools.py", "none"),
    "parallel_tool_calls": ("honoured test_chat_tools.py", False),
    "stream": ("honoured test_server_openai.py", False),
    "stream_options": ("honoured test_server_openai.py", None),  # with stream, below
    "reasoning_effort": ("honoured test_server_responses_agents.py", "low"),
    "verbosity": ("accepted", "high"),
    "prediction": ("accepted", {"type": "content", "content": "Hello"}),
    "modalities": ("accepted", ["text"]),
    "web_search_options": ("accepted", {"search_context_size": "low"}),
    "metadata": ("accepted", {"k": "v"}),
    "store": ("accepted", True),
    "service_tier": ("accepted", "flex"),
    "user": ("accepted", "u-1"),
    "safety_identifier": ("accepted", "h-1"),
    "prompt_cache_key": ("accepted", "session-1"),
    "prompt_cache_options": ("accepted", {"mode": "implicit", "ttl": "30m"}),
    "prompt_cache_retention": ("accepted", "in_memory"),
    "audio": ("refused", {"voice": "alloy", "format": "wav"}),
    "moderation": ("refused", {"model": "omni-moderation-latest"}),
    "functions": ("refused", [{"name": "f", "parameters": {"type": "object"}}]),
    "function_call": ("refused", "auto"),
}


def sdk_fields(*params: type) -> set[str]:
    return set().union(*(p.__required_keys__ | p.__optional_keys__ for p in params))


def test_every_sdk_field_is_classified() -> None:
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as resp

    responses = sdk_fields(
        resp.ResponseCreateParamsNonStreaming, resp.ResponseCreateParamsStreaming
    )
    completions = sdk_fields(
        chat.CompletionCreateParamsNonStreaming, chat.CompletionCreateParamsStreaming
    )
    assert sorted(responses - set(RESPONSES_FIELDS)) == [], "classify these Responses fields"
    assert sorted(completions - set(CHAT_FIELDS)) == [], "classify these chat fields"
    docs = (ROOT / "docs" / "api-fields.md").read_text()
    for field in sorted(responses | completions | set(RESPONSES_EXTRA)):
        assert f"`{field}`" in docs, f"docs/api-fields.md does not describe {field!r}"
    for what, _ in (*RESPONSES_FIELDS.values(), *CHAT_FIELDS.values()):
        if what.startswith("honoured"):
            assert (ROOT / "tests" / what.split()[1]).exists(), what


@pytest.mark.parametrize("field", sorted(RESPONSES_FIELDS | RESPONSES_EXTRA))
def test_responses_field(server, field: str) -> None:
    what, value = (RESPONSES_FIELDS | RESPONSES_EXTRA)[field]
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 2}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        if value == PREV:
            prev = http.post("/v1/responses", json=body)
            value = prev.json()["id"]
        r = http.post("/v1/responses", json=body | {field: value})
        if what == "refused":
            err = assert_openai_error(r, 400, field)
            assert "not supported" in err["message"]
        else:
            assert r.status_code == 200, r.text
            assert r.json()["object"] == "response"


@pytest.mark.parametrize("field", sorted(CHAT_FIELDS))
def test_chat_field(server, field: str) -> None:
    what, value = CHAT_FIELDS[field]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    extra = {field: value}
    if field == "top_logprobs":
        extra = {"logprobs": True, "top_logprobs": 2}
    elif field == "stream_options":
        extra = {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=body | extra)
        if what == "refused":
            err = assert_openai_error(r, 400, field)
            assert "not supported" in err["message"]
        else:
            assert r.status_code == 200, r.text
    if field == "modalities":  # audio among them is refused, as audio itself
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/v1/chat/completions", json=body | {"modalities": ["text", "audio"]})
        assert_openai_error(r, 400, "modalities")
