"""Tool-call and reasoning parsers on literal model outputs, written by hand from the formats
the model cards document; streamed at every character boundary, the deltas add up to the
non-streamed result, which equals the hand-written expectation."""

from __future__ import annotations

import json
import random
import re

import pytest

from mlxserve.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    OutputParser,
    ParsedMessage,
    aggregate,
    tool_parser_for_template,
)

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "square_the_number",
            "parameters": {"type": "object", "properties": {"input_num": {"type": "number"}}},
        },
    },
]

# (parser, output text, expected content, expected [(name, arguments)]).
TOOL_CASES = [
    # Qwen2.5 / Qwen3 function calling docs (Hermes style), two calls.
    (
        "hermes",
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
        '"San Francisco, CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": '
        '"get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
        '"date": "2024-10-01"}}\n</tool_call>',
        "",
        [
            ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
            ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}),
        ],
    ),
    (
        "hermes",
        'Let me look that up.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris <b>"}}\n</tool_call>',
        "Let me look that up.",
        [("get_weather", {"city": "Paris <b>"})],
    ),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.\n", None, []),
    (
        "hermes",  # a malformed call comes back as the text the model wrote
        "<tool_call>\n{not json}\n</tool_call>",
        "<tool_call>\n{not json}\n</tool_call>",
        [],
    ),
    (
        "hermes",  # cut off before the closing tag (EOS or max_tokens): still a call
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n',
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    # Qwen3-Coder model card (XML function/parameter tags), values typed by the schema.
    (
        "qwen3_coder",
        "<tool_call>\n<function=square_the_number>\n<parameter=input_num>\n1024\n"
        "</parameter>\n</function>\n</tool_call>",
        "",
        [("square_the_number", {"input_num": 1024})],
    ),
    (
        "qwen3_coder",
        "I will check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "New York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\n"
        "true\n</parameter>\n<parameter=hours>\n[9, 17]\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n"
        "</parameter>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>",
        "I will check both.",
        [
            ("get_weather", {"city": "New York", "days": 3, "metric": True, "hours": [9, 17]}),
            ("get_weather", {"city": "42", "days": "three"}),  # not an integer: kept as text
        ],
    ),
    # Llama 3.1 / 3.2 model cards: JSON based tool calling ("parameters").
    (
        "llama3_json",
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
        '"unit": "Fahrenheit"}}',
        "",
        [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
        '{"name": "get_weather", "parameters": {"city": "Milan"}}',
        "",
        [("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Milan"})],
    ),
    ("llama3_json", "The weather in {city} is nice.", None, []),
    ("llama3_json", '{"a": 1} is a JSON object.', None, []),
    # Mistral-7B-Instruct-v0.3 (v3 tokenizer): a JSON list after [TOOL_CALLS].
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": '
        '"Paris, France", "format": "celsius"}}]',
        "",
        [("get_current_weather", {"location": "Paris, France", "format": "celsius"})],
    ),
    # Mistral Small 3.2 / Devstral (v11+ tokenizers): name[ARGS]{...} per call.
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather'
        '[ARGS]{"city": "Lyon", "days": 2}',
        "Sure.",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon", "days": 2})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": ',
        '[TOOL_CALLS]get_weather[ARGS]{"city": ',
        [],
    ),
]


def splits(text: str, seed: int) -> list[list[str]]:
    """Every split into two pieces, one character at a time, and random chunkings."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text), rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def calls_of(message: ParsedMessage) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in message.tool_calls]


def streamed(make, pieces: list[str]) -> ParsedMessage:
    parser = make()
    return aggregate([*(parser.feed(p) for p in pieces), parser.finish()])


@pytest.mark.parametrize(("name", "text", "content", "calls"), TOOL_CASES)
def test_tool_parser_on_documented_outputs_streamed_at_every_boundary(
    name, text, content, calls
) -> None:
    make = lambda: TOOL_PARSERS[name](WEATHER_TOOLS)  # noqa: E731
    whole = make().parse(text)
    assert whole.content == (text if content is None else content)
    assert calls_of(whole) == calls
    for c in whole.tool_calls:  # OpenAI-style ids (Mistral: the 9 characters its template wants)
        assert re.fullmatch("[A-Za-z0-9]{9}" if name == "mistral" else "call_[0-9a-f]{24}", c.id)
    assert len({c.id for c in whole.tool_calls}) == len(whole.tool_calls)
    for pieces in splits(text, seed=len(text)):
        got = streamed(make, pieces)
        assert (got.content, calls_of(got)) == (whole.content, calls_of(whole)), pieces


def test_tool_call_deltas_carry_index_id_and_name_once() -> None:
    parser = TOOL_PARSERS["hermes"]()
    text = TOOL_CASES[0][1]
    deltas = [d for ch in text for d in parser.feed(ch).tool_calls] + parser.finish().tool_calls
    assert [d.index for d in deltas] == [0, 1]
    assert all(d.id and d.name for d in deltas)


# (parser, prompt tail, output, expected reasoning, expected content)
REASONING_CASES = [
    # Qwen3 (thinking on): the model writes both tags.
    (
        "qwen3",
        "<|im_start|>assistant\n",
        "<think>\nThe user asks for the capital of France. That is Paris.\n</think>\n\n"
        "The capital of France is Paris.",
        "The user asks for the capital of France. That is Paris.",
        "The capital of France is Paris.",
    ),
    # Qwen3 with enable_thinking=false: the template closes an empty block in the prompt.
    (
        "qwen3",
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "Paris is the capital of France.",
        "",
        "Paris is the capital of France.",
    ),
    # A DeepSeek-R1 distill: the template opens <think>; the reply only closes it.
    (
        "deepseek_r1",
        "<｜Assistant｜><think>\n",
        "Okay, so I need to add 2 and 2. That makes 4.\n</think>\n\nThe answer is **4**.",
        "Okay, so I need to add 2 and 2. That makes 4.",
        "The answer is **4**.",
    ),
    # Cut off while thinking (max_tokens): everything so far is reasoning.
    (
        "deepseek_r1",
        "<｜Assistant｜>",
        "Let me think about <this>",
        "Let me think about <this>",
        "",
    ),
    # SmolLM3 (/think): like Qwen3.
    (
        "smollm3",
        "<|im_start|>assistant\n",
        "<think>\nSimple arithmetic: 3 * 7 = 21.\n</think>\n21",
        "Simple arithmetic: 3 * 7 = 21.",
        "21",
    ),
    # A reply without a think block under a thinking parser: all content, as written.
    ("qwen3", "<|im_start|>assistant\n", " <thin air>\n", "", " <thin air>\n"),
]


@pytest.mark.parametrize(("name", "prompt", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_parser_on_documented_outputs_streamed_at_every_boundary(
    name, prompt, text, reasoning, content
) -> None:
    make = lambda: OutputParser(REASONING_PARSERS[name](prompt))  # noqa: E731
    whole = make().parse(text)
    assert (whole.reasoning_content, whole.content) == (reasoning, content)
    for pieces in splits(text, seed=len(text)):
        got = streamed(make, pieces)
        assert (got.reasoning_content, got.content) == (reasoning, content), pieces


def test_reasoning_then_tool_calls_qwen3() -> None:
    text = (
        "<think>\nI should call the weather tool for Paris.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )

    def make() -> OutputParser:
        return OutputParser(REASONING_PARSERS["qwen3"]("x"), TOOL_PARSERS["hermes"](WEATHER_TOOLS))

    whole = make().parse(text)
    assert whole.reasoning_content == "I should call the weather tool for Paris."
    assert (whole.content, calls_of(whole)) == ("", [("get_weather", {"city": "Paris"})])
    for pieces in splits(text, seed=1):
        got = streamed(make, pieces)
        assert (got.reasoning_content, got.content, calls_of(got)) == (
            whole.reasoning_content,
            whole.content,
            calls_of(whole),
        )


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        # Excerpts of the models' chat templates (what each asks the model to write).
        ('...<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}', "hermes"),
        ("...<tool_call>\\n<function=example_function_name>\\n<parameter=...", "qwen3_coder"),
        ("...{%- if message.tool_calls %}[TOOL_CALLS]{{ ... }}", "mistral"),
        ('...{{- "<|python_tag|>" + tool_call.name }}...<|eot_id|>', "llama3_json"),
        ("{% for m in messages %}<|im_start|>{{ m['role'] }}...", None),
        (None, None),
    ],
)
def test_tool_parser_is_picked_from_the_chat_template(template, parser) -> None:
    assert tool_parser_for_template(template) == parser
