"""Tools and structured output on the Anthropic, Responses and Ollama APIs (embedded SmolLM2).

The official clients drive one `mlxserve serve`; a forced call (named tool) goes through
the same planning, grammar and Hermes parser as /v1/chat/completions. Oracle: jsonschema
validates every call's arguments and every structured answer against the schema sent.
"""

from __future__ import annotations

import json
import re

import anthropic
import jsonschema
import ollama
import openai
import pytest
from openai import OpenAI

from tests.server_harness import metric, read_metrics, start_server

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    s = start_server(["--max-model-len", "1024", "--disable-log-stats"], log)
    yield s
    s.stop()


def test_anthropic_tool_use_round_trip(server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="-", max_retries=0)
    tool = {"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}
    args = {"model": MODEL, "max_tokens": 60, "tools": [tool], "extra_body": {"temperature": 0}}
    question = [{"role": "user", "content": QUESTION}]
    forced = {"type": "tool", "name": "get_weather"}
    msg = client.messages.create(messages=question, tool_choice=forced, **args)
    (call,) = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and call.name == "get_weather" and call.id
    jsonschema.validate(call.input, SCHEMA)
    with client.messages.stream(messages=question, tool_choice=forced, **args) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert json.loads(partial) == streamed.input == call.input
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}
    turns = question + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [result]},
    ]
    answer = client.messages.create(messages=turns, **args | {"max_tokens": 24})
    assert answer.content[0].type == "text" and answer.content[0].text
    # Cut by max_tokens half written: "max_tokens", and the call's raw markup is no text.
    cut = client.messages.create(messages=question, tool_choice=forced, **args | {"max_tokens": 6})
    assert cut.stop_reason == "max_tokens"
    assert not any(b.type == "text" and b.text for b in cut.content)
    with_tools = client.messages.count_tokens(model=MODEL, messages=turns, tools=[tool])
    without = client.messages.count_tokens(model=MODEL, messages=question)
    assert with_tools.input_tokens > without.input_tokens


def test_responses_function_call_round_trip_and_json_schema(server) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    tool = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
    args = {"model": MODEL, "temperature": 0, "tools": [tool], "max_output_tokens": 60}
    forced = {"type": "function", "name": "get_weather"}
    first = client.responses.create(input=QUESTION, tool_choice=forced, **args)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    events = list(client.responses.create(input=QUESTION, tool_choice=forced, stream=True, **args))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments and events[-1].type == "response.completed"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    second = client.responses.create(input=[output], previous_response_id=first.id, **args)
    assert second.output_text and second.previous_response_id == first.id
    fmt = {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}
    structured = client.responses.create(
        model=MODEL, input=QUESTION, text={"format": fmt}, max_output_tokens=40, temperature=0
    )
    jsonschema.validate(json.loads(structured.output_text), SCHEMA)


def test_ollama_format_and_tools(server) -> None:
    client = ollama.Client(host=server.url)
    messages = [{"role": "user", "content": QUESTION}]
    options = {"temperature": 0, "num_predict": 40}
    out = client.chat(MODEL, messages=messages, format=SCHEMA, options=options)
    jsonschema.validate(json.loads(out.message.content), SCHEMA)
    out = client.generate(MODEL, QUESTION, format=SCHEMA, options=options, stream=True)
    jsonschema.validate(json.loads("".join(part.response for part in out)), SCHEMA)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
    plain = client.chat(MODEL, messages=messages, options=options | {"num_predict": 1})
    with_tools = client.chat(MODEL, messages=messages, tools=[tool], options=options)
    assert with_tools.prompt_eval_count > plain.prompt_eval_count  # the tools are in the prompt
    for call in with_tools.message.tool_calls or ():  # whether it calls is the model's choice
        assert call.function.name == "get_weather"
        jsonschema.validate(call.function.arguments, SCHEMA)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(MODEL, messages=messages, format={"type": "nonsense"}, options=options)
    assert e.value.status_code == 400 and "invalid or unsupported JSON schema" in e.value.error
    values = read_metrics(server.url)
    assert metric(values, "vllm:kv_cache_usage_perc", model_name=MODEL) == 0


READ_SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string", "maxLength": 12}},
    "required": ["path"],
    "additionalProperties": False,
}
PATCH_REGEX = "[a-z]{1,6}"
AGENT_TOOLS = [
    {
        "type": "namespace",
        "name": "mcp__fs__",
        "description": "A file system server.",
        "tools": [
            {"type": "function", "name": "read", "description": "Read a file.", "strict": True,
             "parameters": READ_SCHEMA},
        ],
    },
    {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
     "format": {"type": "grammar", "syntax": "regex", "definition": PATCH_REGEX}},
    {"type": "local_shell"},
    {"type": "web_search"},
]  # fmt: skip


def test_responses_namespaced_custom_and_local_shell_calls_are_their_items(server) -> None:
    """Forced calls of each tool kind come back as the item the Responses API defines."""
    client = OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    args = {"model": MODEL, "input": "Fix the bug in main.py.", "tools": AGENT_TOOLS,
            "temperature": 0, "max_output_tokens": 60, "reasoning": {"effort": "none"}}  # fmt: skip
    first = client.responses.create(tool_choice={"type": "function", "name": "read"}, **args)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert (call.name, call.namespace) == ("read", "mcp__fs__")
    jsonschema.validate(json.loads(call.arguments), READ_SCHEMA)
    patch = {"type": "custom", "name": "apply_patch"}
    custom = client.responses.create(tool_choice=patch, **args)
    (item,) = [o for o in custom.output if o.type == "custom_tool_call"]
    assert item.name == "apply_patch" and re.fullmatch(PATCH_REGEX, item.input)
    events = list(client.responses.create(tool_choice=patch, stream=True, **args))
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert "".join(deltas) == done.input == item.input
    assert [e.sequence_number for e in events] == list(range(len(events)))
    shell = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "local_shell"}]}
    resp = client.responses.create(tool_choice=shell, **args)
    (run,) = [o for o in resp.output if o.type == "local_shell_call"]
    assert run.action.type == "exec" and all(isinstance(c, str) for c in run.action.command)
    # The calls, sent back with their outputs, are the next turn's history.
    history = [
        {"role": "user", "content": "Fix the bug in main.py."},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "x = 1"},
        item.model_dump(exclude_none=True),
        {"type": "custom_tool_call_output", "call_id": item.call_id, "output": "Done."},
    ]
    nxt = client.responses.create(**args | {"input": history, "max_output_tokens": 8})
    assert nxt.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(tool_choice={"type": "web_search_preview"}, **args)
    assert e.value.body["param"] == "tool_choice"
