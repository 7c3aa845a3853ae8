"""The chat side of tools and reasoning, without a model: which format a template gets, what
the template renders (natively or through the fallback), forced-call grammars, and the
OpenAI shape of parsed replies (streamed deltas add up to the whole message)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from mlxserve.exceptions import ParameterError
from mlxserve.parsers.tool_grammar import call_grammar
from mlxserve.sampling_params import StructuredOutputsParams
from mlxserve.server.chat_tools import ChatFeatures, ReplyFormatter
from mlxserve.server.protocol import ChatCompletionRequest
from mlxserve.structured_output.grammar import GrammarCompiler
from mlxserve.tokenizer import Tokenizer
from tests.engine_helpers import VOCAB_SIZE, write_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
# A Qwen3-style template excerpt: renders tools, asks for Hermes calls, knows <think>.
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    '</tools>\nCall as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)  # a ChatML template without tools (as SmolLM2's)
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("qwen")
    write_tokenizer(path)
    tok = Tokenizer.from_dir(path)
    tok.chat_templates = QWEN_LIKE
    return tok


def request(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}]} | fields
    return ChatCompletionRequest.model_validate(body)


def plan_of(features: ChatFeatures, req: ChatCompletionRequest, params=None):
    """What the chat endpoint asks of ChatFeatures for ``req``."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    params = params if params is not None else req.sampling_params()
    parallel = req.parallel_tool_calls is not False
    return features.plan(req.template_messages(), tools, req.tool_choice_name(), parallel, params)


def test_a_template_without_tools_gets_them_in_the_system_message(tokenizer) -> None:
    features = ChatFeatures(tokenizer)
    assert (features.native_tools, features.tool_parser, features.reasoning) == (
        False,
        "hermes",
        None,
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
            "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "24 C"},
    ]
    plan = plan_of(features, request(messages=messages, tools=[WEATHER]))
    text = tokenizer.apply_chat_template(plan.messages, tools=plan.tools)
    assert text.startswith("<|im_start|>system\nYou can call functions.")
    assert json.dumps(WEATHER) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' in text
    assert (
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n24 C\n</tool_response>" in text
    )
    # No tools and no calls: the messages go to the template untouched.
    plain = plan_of(features, request())
    assert plain.messages == request().template_messages() and plain.tool_parser is None


def test_a_template_with_tools_renders_them_itself(qwen_like) -> None:
    features = ChatFeatures(qwen_like)
    assert (features.native_tools, features.tool_parser) == (True, "hermes")
    assert features.reasoning is not None  # the template knows </think>
    call = {"id": "c", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    plan = plan_of(features, request(messages=messages, tools=[WEATHER]))
    text = qwen_like.apply_chat_template(plan.messages, tools=plan.tools)
    # Arguments handed to the template as an object, not a JSON string in a string.
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert "<tools>" + json.dumps(WEATHER) in text
    none = plan_of(features, request(tools=[WEATHER], tool_choice="none"))
    assert none.tools is None and none.tool_parser is None  # left out, not parsed


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
            "tool_choice",
        ),
    ],
)
def test_tool_choice_that_cannot_be_honoured_is_a_400(tokenizer, fields, param) -> None:
    with pytest.raises(ParameterError) as e:
        plan_of(ChatFeatures(tokenizer), request(**fields))
    assert e.value.parameter == param


def accepts(grammar, tokenizer, text: str) -> bool:
    """Whether ``grammar`` takes ``text``'s tokens and may end there."""
    state = grammar.new_state(frozenset({tokenizer.eos_token_id}))
    try:
        for t in tokenizer.encode(text, add_special_tokens=False):
            state.accept(t)
    except ValueError:
        return False
    return state.matcher.is_accepting()


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder", "llama3_json", "mistral"])
def test_forced_call_grammars_accept_exactly_valid_calls(tokenizer, parser) -> None:
    functions = [WEATHER["function"], CLOCK["function"]]
    compiler = GrammarCompiler(tokenizer, VOCAB_SIZE)
    grammar = compiler.compile(
        StructuredOutputsParams(grammar=call_grammar(parser, functions, parallel=True))
    )
    calls = {
        "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
        "</tool_call>",
        "llama3_json": '{"name": "get_weather", "parameters": {"city": "Rome"}}',
        "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
    }
    good = calls.get(parser, calls["hermes"])
    bad = [
        good.replace('"Rome"', "42"),  # city must be a string
        good.replace('"Rome"}', '"Rome", "extra": 1}'),  # undeclared argument
        good.replace("get_weather", "get_wether"),  # not a tool
        "Sure! " + good,  # text before the call
    ]

    assert accepts(grammar, tokenizer, good)
    wrongly_accepted = [b for b in bad if accepts(grammar, tokenizer, b)]
    assert not wrongly_accepted, wrongly_accepted
    # The call the grammar forces is what the format's parser reads.
    from mlxserve.parsers import TOOL_PARSERS

    parsed = TOOL_PARSERS[parser]().parse(good)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Rome"})
    ]


def test_tool_schema_errors_name_tools(tokenizer) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
    grammar = call_grammar("hermes", [bad["function"]], parallel=False)
    with pytest.raises(ParameterError, match="strin"):
        GrammarCompiler(tokenizer, VOCAB_SIZE).compile(StructuredOutputsParams(grammar=grammar))
    # At the HTTP boundary it never gets that far: the schema is checked, its field named.
    from pydantic import ValidationError

    for choice in ("auto", "required"):
        with pytest.raises(ValidationError) as e:
            request(tools=[bad], tool_choice=choice)
        assert e.value.errors()[0]["loc"] == ("tools", 0, "function", "parameters")
    req = request(tools=[WEATHER], tool_choice="required")
    assert req.field_names()["structured_outputs.grammar"] == "tools"


REPLY = (
    "<think>\nThe user wants the weather.\n</think>\n\nChecking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_deltas_add_up_to_the_message(qwen_like, parallel) -> None:
    req = request(tools=[WEATHER, CLOCK], parallel_tool_calls=parallel)
    plan = plan_of(ChatFeatures(qwen_like), req)
    whole = ReplyFormatter(plan, "<|im_start|>assistant\n")
    message = whole.message(REPLY)
    assert message["reasoning_content"] == "The user wants the weather."
    assert message["content"] == "Checking."
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"][
        : 2 if parallel else 1
    ]
    jsonschema.validate(
        json.loads(calls[0]["function"]["arguments"]), WEATHER["function"]["parameters"]
    )
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(REPLY)), 6))
        pieces = [REPLY[a:b] for a, b in zip([0, *cuts], [*cuts, len(REPLY)], strict=True)]
        reply = ReplyFormatter(plan, "<|im_start|>assistant\n")
        deltas = [d for i, p in enumerate(pieces) for d in reply.delta(p, i == len(pieces) - 1)]
        got = {"reasoning_content": "", "content": "", "tool_calls": {}}
        for d in deltas:
            assert len(d) == 1  # one kind of delta per chunk
            for tc in d.get("tool_calls", []):
                entry = got["tool_calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
                if "id" in tc:  # the first chunk of a call: id, type, name
                    assert tc["type"] == "function" and tc["function"]["arguments"] == ""
                    entry["id"], entry["name"] = tc["id"], tc["function"]["name"]
                entry["arguments"] += tc["function"]["arguments"]
            for key in ("reasoning_content", "content"):
                got[key] += d.get(key, "")
        assert got["reasoning_content"] == message["reasoning_content"]
        assert got["content"] == message["content"]
        assert [(c["name"], c["arguments"]) for c in got["tool_calls"].values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls
        ]
        assert reply.finish_reason("stop") == "tool_calls"


def test_a_constraint_applies_after_the_reasoning_unless_the_prompt_closed_it(qwen_like) -> None:
    req = request(guided_choice=["yes", "no"])
    plan = plan_of(ChatFeatures(qwen_like), req)
    params = req.sampling_params()
    assert plan.grammar_starts_after("<|im_start|>assistant\n", params) == "</think>"
    assert plan.grammar_starts_after("assistant\n<think>\n", params) == "</think>"
    closed = "assistant\n<think>\n\n</think>\n\n"  # enable_thinking=false
    assert plan.grammar_starts_after(closed, params) is None
    free = request()
    assert (
        plan_of(ChatFeatures(qwen_like), free).grammar_starts_after("x", free.sampling_params())
        is None
    )


# Markers some vocabularies spell as one token (Qwen2.5's <tool_call> is id 151657, an added
# token llguidance keeps apart from text; Llama's <|python_tag|>, Mistral's [TOOL_CALLS]).
MARKERS = ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"]
FORCED_CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    "qwen3_coder": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
    "</tool_call>",
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
}


@pytest.fixture(scope="module", params=[True, False], ids=["special", "added"])
def marker_tokenizer(tmp_path_factory: pytest.TempPathFactory, request) -> Tokenizer:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    path = tmp_path_factory.mktemp("markers")
    write_tokenizer(path)
    backend = Backend.from_file(str(path / "tokenizer.json"))
    backend.add_tokens([AddedToken(m, special=request.param, normalized=False) for m in MARKERS])
    backend.save(str(path / "tokenizer.json"))
    return Tokenizer.from_dir(path)


@pytest.mark.parametrize("parser", list(FORCED_CALLS))
@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_forced_calls_take_markers_that_are_one_token(marker_tokenizer, parser, choice) -> None:
    import numpy as np

    from mlxserve.structured_output.grammar import bitmask_words

    tok = marker_tokenizer
    named = {"type": "function", "function": {"name": choice}}
    req = request(tools=[WEATHER, CLOCK], tool_choice=choice if choice == "required" else named)
    params = req.sampling_params()
    plan = plan_of(ChatFeatures(tok, tool_call_parser=parser), req, params)
    text = FORCED_CALLS[parser]
    ids = tok.encode(text, add_special_tokens=False)
    assert {tok.token_to_id(m) for m in MARKERS if m in text} <= set(ids)  # one token each
    vocab_size = tok.backend.get_vocab_size()
    grammar = GrammarCompiler(tok, vocab_size).compile(params.structured_outputs)
    state = grammar.new_state(frozenset({tok.eos_token_id}))
    for t in ids:  # as the sampler does: pick under the mask, then advance the grammar
        row = np.full(bitmask_words(vocab_size), -1, dtype=np.int32)
        state.fill_bitmask(row)
        assert (int(row[t >> 5]) >> (t & 31)) & 1, f"token {t} ({tok.decode([t])!r}) masked"
        state.accept(t)
    assert state.matcher.is_accepting()
    # The reply as the server decodes it still has its markers, so the parser finds the call.
    reply = tok.decode(ids, skip_special_tokens=params.skip_special_tokens)
    message = ReplyFormatter(plan, "").message(reply)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in
             message["tool_calls"]]  # fmt: skip
    assert calls == [("get_weather", {"city": "Rome"})]
    assert message["content"] is None


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_a_forced_call_on_a_harmony_model(tmp_path, choice) -> None:
    """gpt-oss: its markers are special tokens; the grammar lets it reason, then call."""
    import numpy as np
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    from mlxserve.structured_output.grammar import bitmask_words
    from mlxserve.tokenizer.harmony import HARMONY_TEXT_TOKENS, HARMONY_TOKENS

    write_tokenizer(tmp_path)
    backend = Backend.from_file(str(tmp_path / "tokenizer.json"))
    specials = dict.fromkeys([*HARMONY_TOKENS, *HARMONY_TEXT_TOKENS])
    backend.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_format == "harmony"
    named = {"type": "function", "function": {"name": choice}}
    req = request(tools=[WEATHER, CLOCK], tool_choice=choice if choice == "required" else named)
    params = req.sampling_params()
    plan = plan_of(ChatFeatures(tok), req, params)
    reply = (
        "<|channel|>analysis<|message|>The user asks <about> Rome.\nCall it.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Rome"}'
    )
    ids = tok.encode(reply, add_special_tokens=False)
    vocab_size = tok.backend.get_vocab_size()
    grammar = GrammarCompiler(tok, vocab_size).compile(params.structured_outputs)
    call_id = tok.token_to_id("<|call|>")
    state = grammar.new_state(frozenset({call_id}))
    for t in [*ids, call_id]:  # the reply, then the end token that ends a call
        row = np.full(bitmask_words(vocab_size), -1, dtype=np.int32)
        state.fill_bitmask(row)
        assert (int(row[t >> 5]) >> (t & 31)) & 1, f"token {t} ({tok.decode([t])!r}) masked"
        state.accept(t)
    text = tok.decode(ids, skip_special_tokens=params.skip_special_tokens)
    message = ReplyFormatter(plan, "").message(text)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in
             message["tool_calls"]]  # fmt: skip
    assert calls == [("get_weather", {"city": "Rome"})]
    assert message["reasoning_content"] == "The user asks <about> Rome.\nCall it."
    # A reply that is not a call of a named tool is refused token by token.
    state = grammar.new_state(frozenset({call_id}))
    final = tok.encode("<|channel|>final<|message|>Hi", add_special_tokens=False)
    with pytest.raises(ValueError):
        for t in final:
            state.accept(t)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_forced_calls_take_schemas_with_definitions_and_references(tokenizer, parser) -> None:
    # Pydantic and zod write nested models as $defs + $ref; the call wraps the arguments one
    # level down, and each reference must still find what it names.
    schema = {
        "type": "object",
        "properties": {
            "where": {"$ref": "#/$defs/Place"},
            "also": {"$ref": "#/definitions/Unit"},
            "same": {"$ref": "#/properties/where"},
        },
        "required": ["where"],
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}}},
        "definitions": {"Unit": {"enum": ["C", "F"]}},
    }
    functions = [{"name": "get_weather", "parameters": schema}]
    grammar = GrammarCompiler(tokenizer, VOCAB_SIZE).compile(
        StructuredOutputsParams(grammar=call_grammar(parser, functions, parallel=False))
    )
    key = "arguments" if parser == "hermes" else "parameters"

    def call(arguments: str) -> bool:
        text = f'{{"name": "get_weather", "{key}": {arguments}}}'
        if parser == "hermes":
            text = f"<tool_call>\n{text}\n</tool_call>"
        return accepts(grammar, tokenizer, text)

    assert call('{"where": {"city": "Rome"}, "also": "C", "same": {"city": "Oslo"}}')
    assert not call('{"where": {"city": 3}}')  # Place.city is a string
    assert not call('{"where": {"city": "Rome"}, "also": "K"}')  # not a Unit
    assert not call('{"also": "C"}')  # where is required
