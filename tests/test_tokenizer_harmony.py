"""The harmony format (gpt-oss) against openai-harmony, OpenAI's reference implementation.

Rendering: the same conversations built as OpenAI chat messages (mlxserve) and as
openai-harmony Conversations (the oracle) give the same prompt text. Parsing: completions
encoded with the real o200k vocabulary and parsed by openai-harmony give the channels,
recipients and bodies mlxserve's parser reports, streamed at every character boundary.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from mlxserve.parsers.base import ParsedDelta
from mlxserve.parsers.harmony import HarmonyParser
from mlxserve.tokenizer import IncrementalDetokenizer, Tokenizer
from mlxserve.tokenizer.harmony import render_harmony
from tests.harmony_oracle import load_encoding

h = pytest.importorskip("openai_harmony")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {
                    "type": "string",
                    "description": "The city and state, e.g. San Francisco, CA",
                },
                "format": {
                    "type": "string",
                    "enum": ["celsius", "fahrenheit"],
                    "default": "celsius",
                },
            },
            "required": ["location"],
        },
    },
}
KITCHEN_SINK = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Line one.\nLine two.",
        "parameters": {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "description": "count"},
                "x": {"type": "number"},
                "flag": {"type": "boolean", "default": False},
                "tags": {"type": "array", "items": {"type": "string"}},
                "obj": {
                    "type": "object",
                    "properties": {
                        "a": {"type": "string"},
                        "b": {"type": "integer", "description": "inner"},
                    },
                    "required": ["a"],
                },
                "nullable": {"type": ["string", "null"]},
                "either": {
                    "oneOf": [{"type": "string", "description": "as text"}, {"type": "number"}]
                },
                "rows": {
                    "type": "array",
                    "items": {"type": "object", "properties": {"k": {"type": "string"}}},
                },
                "free": {},
            },
            "required": ["n"],
        },
    },
}
NO_PARAMS = {"type": "function", "function": {"name": "get_location", "description": "Where am I."}}


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    return load_encoding(tmp_path_factory.mktemp("o200k"))


def tool_description(tool: dict):
    fn = tool["function"]
    return h.ToolDescription.new(
        fn["name"], fn.get("description", ""), parameters=fn.get("parameters")
    )


def oracle_text(enc, messages: list, system=None, tools=None, instructions=None) -> str:
    conv = [h.Message.from_role_and_content(h.Role.SYSTEM, system or h.SystemContent.new())]
    if instructions or tools:
        dev = h.DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions(instructions)
        if tools:
            dev = dev.with_function_tools([tool_description(t) for t in tools])
        conv.append(h.Message.from_role_and_content(h.Role.DEVELOPER, dev))
    conv += messages
    tokens = enc.render_conversation_for_completion(
        h.Conversation.from_messages(conv), h.Role.ASSISTANT
    )
    return enc.decode_utf8(tokens)


def user(text: str):
    return h.Message.from_role_and_content(h.Role.USER, text)


def assistant(text: str, channel: str, recipient: str | None = None):
    m = h.Message.from_role_and_content(h.Role.ASSISTANT, text).with_channel(channel)
    if recipient:
        m = m.with_recipient(recipient).with_content_type("<|constrain|>json")
    return m


def tool_result(name: str, text: str):
    author = h.Author.new(h.Role.TOOL, f"functions.{name}")
    return (
        h.Message.from_author_and_content(author, text)
        .with_channel("commentary")
        .with_recipient("assistant")
    )


def test_plain_conversation(enc) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert render_harmony(messages) == oracle_text(enc, [user("Hi")])


def test_instructions_effort_and_date(enc) -> None:
    messages = [
        {"role": "system", "content": "Answer in riddles."},
        {"role": "user", "content": "Hi"},
    ]
    system = h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort.HIGH)
    system = system.with_conversation_start_date("2025-06-28")
    want = oracle_text(enc, [user("Hi")], system=system, instructions="Answer in riddles.")
    assert render_harmony(messages, reasoning_effort="high", current_date="2025-06-28") == want


@pytest.mark.parametrize("tools", [[WEATHER, NO_PARAMS], [KITCHEN_SINK]], ids=["weather", "schema"])
def test_tool_call_round_trip(enc, tools: list) -> None:
    """Tools as TypeScript, a call with its reasoning, the result, then the next turn."""
    args = json.dumps({"location": "San Francisco"})
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in SF?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need the weather tool.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_current_weather", "arguments": args},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"sunny": true}'},
    ]
    want = oracle_text(
        enc,
        [
            user("Weather in SF?"),
            assistant("Need the weather tool.", "analysis"),
            assistant(args, "commentary", "functions.get_current_weather"),
            tool_result("get_current_weather", '{"sunny": true}'),
        ],
        tools=tools,
        instructions="Be brief.",
    )
    assert render_harmony(messages, tools=tools) == want


def test_reasoning_before_the_last_answer_is_dropped(enc) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"},
    ]
    want = oracle_text(
        enc,
        [
            user("Hi"),
            assistant("Greet back.", "analysis"),
            assistant("Hello!", "final"),
            user("Bye"),
        ],
    )
    assert render_harmony(messages) == want


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="reasoning_effort 'extreme'"):
        render_harmony([{"role": "user", "content": "x"}], reasoning_effort="extreme")
    with pytest.raises(ValueError, match="tool message must name its function"):
        render_harmony([{"role": "tool", "tool_call_id": "nope", "content": "x"}])


# ---- parsing the model's output ------------------------------------------------------------
COMPLETIONS = {
    "answer": "<|channel|>analysis<|message|>User says hi; greet.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>",
    "tool_call": "<|channel|>analysis<|message|>Need weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_current_weather "
    '<|constrain|>json<|message|>{"location": "SF"}<|call|>',
    "recipient_first": "<|channel|>analysis<|message|>Hmm<|end|>"
    "<|start|>assistant to=functions.get_location<|channel|>commentary json<|message|>{}<|call|>",
    "preamble_then_call": "<|channel|>commentary<|message|>Let me check.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json"
    '<|message|>{"n": 1}<|call|>',
}


def oracle_parse(enc, text: str) -> ParsedDelta:
    """openai-harmony's messages folded into the parser's fields."""
    tokens = enc.encode(text, allowed_special="all")
    out = ParsedDelta()
    for m in enc.parse_messages_from_completion_tokens(tokens, h.Role.ASSISTANT):
        body = "".join(c.text for c in m.content)
        if m.recipient and m.recipient.startswith("functions."):
            out.tool_calls.append((m.recipient.removeprefix("functions."), body))
        elif m.channel == "analysis":
            out.reasoning_content += body
        else:
            out.content += body
    return out


@pytest.mark.parametrize("name", sorted(COMPLETIONS))
def test_parser_agrees_with_openai_harmony(enc, name: str) -> None:
    text = COMPLETIONS[name]
    want = oracle_parse(enc, text)
    whole = HarmonyParser().parse(text)
    assert (whole.content, whole.reasoning_content) == (want.content, want.reasoning_content)
    assert [(c.name, c.arguments) for c in whole.tool_calls] == want.tool_calls
    assert [c.index for c in whole.tool_calls] == list(range(len(want.tool_calls)))
    for cut in range(1, len(text)):  # streamed in two pieces at every boundary: the same
        parser = HarmonyParser()
        out = parser.feed(text[:cut])
        out += parser.feed(text[cut:])
        out += parser.finish()
        assert (out.content, out.reasoning_content) == (whole.content, whole.reasoning_content)
        assert [(c.name, c.arguments) for c in out.tool_calls] == want.tool_calls


def test_text_streams_as_it_arrives_and_holds_partial_tokens() -> None:
    parser = HarmonyParser()
    assert parser.feed("<|channel|>analysis<|message|>Think").reasoning_content == "Think"
    assert parser.feed("ing <|e").reasoning_content == "ing "  # "<|e" may start <|end|>
    assert parser.feed("nd|><|start|>assistant<|channel|>final<|message|>Hi").content == "Hi"
    assert parser.finish().content == ""


def test_output_outside_the_format_is_content() -> None:
    assert HarmonyParser().parse("just text").content == "just text"


# ---- gpt-oss's tokenizers (GGUF, directory): the prompt and output `mlxserve serve` handles ----
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>"]
SPECIALS += ["<|start|>", "<|end|>", "<|message|>", "<|call|>"]
BYTES = sorted(pre_tokenizers.ByteLevel.alphabet())


@pytest.fixture(scope="module")
def gguf_tok() -> Tokenizer:
    """A gpt-oss-shaped GGUF vocabulary (llama.cpp's keys): the 256 byte tokens, no merges,
    and o200k_harmony's special tokens, all CONTROL as the converter writes them."""
    tokens = BYTES + SPECIALS
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-4o",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 256 + [3] * len(SPECIALS),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": tokens.index("<|startoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|return|>"),
        "tokenizer.chat_template": "{{ 'the Jinja template' }}",
    }
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def dir_tok() -> Tokenizer:
    """The same as a tokenizer.json (special added tokens) with gpt-oss's generation_config
    eos ids (<|return|>, <|endoftext|>, <|call|>)."""
    backend = Backend(models.BPE({t: i for i, t in enumerate(BYTES)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False) for t in SPECIALS])
    eos = [backend.token_to_id(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>")]
    return Tokenizer(backend, eos_token_id=eos[0], extra_eos_token_ids=eos[1:])


@pytest.mark.parametrize("kind", ["gguf_tok", "dir_tok"])
def test_chat_is_rendered_in_harmony(enc, request, kind: str) -> None:
    """The server's chat rendering (apply_chat_template, chat_template_kwargs as options) of a
    gpt-oss vocabulary is openai-harmony's prompt, with the same special tokens."""
    tok = request.getfixturevalue(kind)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    kwargs = {"reasoning_effort": "low", "current_date": "2025-06-28"}
    text = tok.apply_chat_template(messages, tools=[WEATHER], **kwargs)
    system = h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort.LOW)
    system = system.with_conversation_start_date("2025-06-28")
    want = oracle_text(enc, [user("Hi")], system, [WEATHER], "Be brief.")
    assert text == want
    ids = tok.encode_rendered_chat(text)
    specials = [tok.id_to_token(i) for i in ids if i >= 256]
    oracle_ids = enc.encode(want, allowed_special="all")
    assert specials == [enc.decode([i]) for i in oracle_ids if i >= 199998]
    # a template passed explicitly (--chat-template) is used instead
    assert tok.apply_chat_template(messages, chat_template="{{ 'x' }}") == "x"
    with pytest.raises(ValueError, match="continue_final_message"):
        tok.apply_chat_template(messages, continue_final_message=True)


@pytest.mark.parametrize("kind", ["gguf_tok", "dir_tok"])
@pytest.mark.parametrize("name", ["answer", "tool_call"])
def test_output_keeps_its_channels(enc, request, kind: str, name: str) -> None:
    """As llama.cpp: <|end|> does not stop a gpt-oss generation, <|return|> / <|call|> do, and
    the decoded output (special tokens skipped, as served; streamed as the server streams
    it) keeps the harmony headers, so the parser recovers what openai-harmony parses."""
    tok = request.getfixturevalue(kind)
    ids = tok.encode(COMPLETIONS[name] + "<|endoftext|>", add_special_tokens=False)
    ends = [i for i, t in enumerate(ids) if t in tok.eos_token_ids]
    assert tok.id_to_token(ids[ends[0]]) in ("<|return|>", "<|call|>")
    output = ids[: ends[0]]  # the stop token is cut
    served = tok.decode(output, skip_special_tokens=True)
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.step([i]) for i in output) + detok.flush() == served
    assert "<|endoftext|>" not in tok.decode(ids, skip_special_tokens=True)
    got, want = HarmonyParser().parse(served), oracle_parse(enc, COMPLETIONS[name])
    assert (got.content, got.reasoning_content) == (want.content, want.reasoning_content)
    assert [(c.name, c.arguments) for c in got.tool_calls] == want.tool_calls


# A gpt-oss reply as the model writes it (the format in OpenAI's harmony guide): reasoning,
# then a call; and reasoning, then the answer. The terminal <|call|> / <|return|> are EOS
# tokens, which the server does not pass on as text.
CALL_REPLY = (
    "<|channel|>analysis<|message|>The user wants the weather in Paris.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    '<|message|>{"city": "Paris"}'
)
ANSWER_REPLY = (
    "<|channel|>analysis<|message|>Easy.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Paris is the capital."
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize(
    ("reply", "want"),
    [
        (CALL_REPLY, ("The user wants the weather in Paris.", None, ["get_weather"])),
        (ANSWER_REPLY, ("Easy.", "Paris is the capital.", [])),
    ],
)
def test_the_server_splits_a_harmony_reply_by_channel(dir_tok, reply: str, want) -> None:
    from mlxserve.sampling_params import SamplingParams
    from mlxserve.server.chat_tools import ChatFeatures, ReplyFormatter

    features = ChatFeatures(dir_tok)
    plan = features.plan(
        [{"role": "user", "content": "hi"}], [WEATHER_TOOL], None, True, SamplingParams()
    )
    whole = ReplyFormatter(plan, "")
    message = whole.message(reply)
    calls = message.get("tool_calls", [])
    assert (
        message["reasoning_content"],
        message["content"],
        [c["function"]["name"] for c in calls],
    ) == want
    if calls:
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
        assert whole.finish_reason("stop") == "tool_calls"
    for cut in range(1, len(reply)):  # streamed, split at every character
        streamed = ReplyFormatter(plan, "")
        deltas = streamed.delta(reply[:cut], False) + streamed.delta(reply[cut:], True)
        text = {k: "".join(d.get(k, "") for d in deltas) for k in ("reasoning_content", "content")}
        args = "".join(
            tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", [])
        )
        assert text == {"reasoning_content": want[0], "content": want[1] or ""}, cut
        assert args == (calls[0]["function"]["arguments"] if calls else ""), cut
