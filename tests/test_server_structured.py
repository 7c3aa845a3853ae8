"""Structured output and tools against `mlxserve serve` on the embedded SmolLM2, with the
official openai SDK and LangChain (one server for the module).

Every output is checked with independent oracles (jsonschema, re.fullmatch, membership),
streamed and not, n = 1 and n = 3, alone and inside a batch of 12 concurrent mixed
constrained and free requests. The examples of docs/tools.md (structured output, tools) run
verbatim.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field

from tests.paths import ROOT
from tests.server_harness import assert_openai_error, start_server

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-structured-test"
TOOLS_DOC = ROOT / "docs" / "tools.md"


class City(BaseModel):
    """What the SDK's .parse() fills in."""

    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=50)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {
            "type": "array",
            "items": {"enum": ["cat", "dog", "fish"]},
            "maxItems": 2,
        },
        "address": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "pets", "address"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
GRAMMAR = 'root ::= "The answer is " ("yes" | "no") "."'
GRAMMAR_RE = r"The answer is (yes|no)\."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    s = start_server(["--max-model-len", "1024"], log, env={"MLXSERVE_API_KEY": KEY})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ------------------------------------------------------------ constraints, checked
KINDS = {
    "json_object": (
        {"response_format": {"type": "json_object"}},
        "Reply with a JSON object with two keys, a and b.",
    ),
    "json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            }
        },
        "Describe a person as JSON.",
    ),
    "regex": ({"extra_body": {"structured_outputs": {"regex": REGEX}}}, "A phone number?"),
    "choice": ({"extra_body": {"guided_choice": CHOICES}}, "Sentiment of 'I love it'?"),
    "grammar": (
        {"extra_body": {"structured_outputs": {"grammar": GRAMMAR}}},
        "Is Paris in France?",
    ),
}


def check(kind: str, text: str) -> None:
    """The independent oracles."""
    if kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "json_schema":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(GRAMMAR_RE, text), text


async def run_one(aclient: AsyncOpenAI, kind: str | None, stream: bool, n: int, seed: int):
    """(kind, [(text, finish_reason)] per sample) of one chat request."""
    extra, prompt = KINDS[kind] if kind else ({}, "Tell me about cats.")
    kwargs = dict(extra) | {"max_tokens": 160 if kind else 16, "n": n, "seed": seed}
    # JSON mode greedy: a free JSON object has no length bound, a small model sampling at
    # temperature 1 may go on; the bounded kinds are sampled.
    kwargs["temperature"] = 0.0 if kind == "json_object" else 1.0
    if not stream:
        r = await aclient.chat.completions.create(model=MODEL, messages=ask(prompt), **kwargs)
        return kind, [(c.message.content, c.finish_reason) for c in r.choices]
    texts, reasons = [""] * n, [None] * n
    s = await aclient.chat.completions.create(
        model=MODEL, messages=ask(prompt), stream=True, **kwargs
    )
    async for chunk in s:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    return kind, list(zip(texts, reasons, strict=True))


def test_every_constraint_in_a_batch_of_12_streamed_or_not_n_1_and_3(server) -> None:
    # Each kind streamed and not, once with n=1 and once with n=3 (which way round
    # alternates by kind, so both n go both ways), beside two free requests.
    plan = []
    for i, kind in enumerate(KINDS):
        for stream in (False, True):
            n = 3 if (i + stream) % 2 == 0 else 1
            plan.append((kind, stream, n, 100 + 10 * i + 2 * stream + n))
    plan += [(None, False, 1, 7), (None, True, 1, 8)]  # free ones
    assert len({p[0] for p in plan}) == len(KINDS) + 1
    assert {(p[1], p[2]) for p in plan[:-2]} == {(s, n) for s in (False, True) for n in (1, 3)}
    again = (3, 4, 6)  # json_schema streamed n=3, regex n=3, choice n=1

    async def main():
        aclient = AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=600)
        results = await asyncio.gather(*(run_one(aclient, *p) for p in plan))
        alone = [await run_one(aclient, *plan[i]) for i in again]  # seeded, one by one
        return results, alone

    results, alone = asyncio.run(main())
    for (kind, stream, n, _), (_, samples) in zip(plan, results, strict=True):
        assert len(samples) == n
        for text, reason in samples:
            if kind is not None:
                assert reason == "stop", (kind, stream, text, reason)
                check(kind, text)
    # A seeded constrained request gives the same output alone as in the batch.
    assert [results[i] for i in again] == alone


def test_completions_take_the_same_constraints(client) -> None:
    out = client.completions.create(
        model=MODEL, prompt="Call me at ", max_tokens=12, temperature=0,
        extra_body={"guided_regex": REGEX},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop" and re.fullmatch(REGEX, out.choices[0].text)


def test_sdk_parse_with_a_pydantic_model_streamed_and_not(client) -> None:
    messages = ask("Give the name, country and population in millions of Rome.")
    out = client.chat.completions.parse(
        model=MODEL, messages=messages, response_format=City, max_tokens=80, temperature=0
    )
    city = out.choices[0].message.parsed
    assert isinstance(city, City)
    jsonschema.validate(json.loads(out.choices[0].message.content), City.model_json_schema())
    with client.chat.completions.stream(
        model=MODEL, messages=messages, response_format=City, max_tokens=80, temperature=0
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == city  # greedy: the same object streamed


# ------------------------------------------------------------------------ tools
def validate_call(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather"
    assert re.fullmatch("call_[0-9a-f]{24}", call.id)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    return args


def test_tool_choice_required_and_named_give_valid_calls(client) -> None:
    messages = ask("What is the weather in Paris?")
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # exactly one call
        max_tokens=80,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1 and not choice.message.content
    validate_call(choice.message.tool_calls[0])
    # Named, streamed: index, id, type and name first, then the arguments.
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[WEATHER],
            tool_choice=named,
            max_tokens=80,
            temperature=0,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    first, rest = deltas[0][0], [d[0] for d in deltas[1:]]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id and all(d.index == 0 and d.id is None for d in rest)
    args = first.function.arguments + "".join(d.function.arguments for d in rest)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)  # never as raw text


def test_a_forced_call_cut_by_max_tokens_is_not_content(client) -> None:
    # The grammar makes the reply a call; max_tokens ends it half written. The client
    # must see "length" and no content (the call's raw markup is not an answer), streamed
    # or not (vLLM #47903 leaks the markup into content).
    kwargs = dict(
        model=MODEL, messages=ask("What is the weather in Paris?"), tools=[WEATHER],
        tool_choice="required", max_tokens=6, temperature=0,
    )  # fmt: skip
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None and not choice.message.tool_calls
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not any(c.choices[0].delta.content or c.choices[0].delta.tool_calls for c in chunks)


def test_a_two_turn_tool_loop_through_the_chat_template(server, client) -> None:
    messages = ask("What is the weather in Oslo?")
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=0,
    )  # fmt: skip
    call = r.choices[0].message.tool_calls[0]
    validate_call(call)
    messages += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Snow, -3 degrees"},
    ]
    # The template (SmolLM2's knows no tools) gets the call and its result as text; with
    # tool_choice "none" the tools themselves stay out of the prompt.
    tokenized = httpx.post(
        server.url + "/tokenize",
        json={"messages": messages},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()
    rendered = httpx.post(
        server.url + "/detokenize",
        json={"tokens": tokenized["tokens"]},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()["prompt"]
    assert "<tool_response>\nSnow, -3 degrees\n</tool_response>" in rendered
    assert f'"name": "get_weather", "arguments": {call.function.arguments}' in rendered
    assert "<tools>" not in rendered
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
        max_tokens=40, temperature=0,
    )  # fmt: skip
    answer = final.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")
    assert final.usage.prompt_tokens == tokenized["count"]  # the very prompt rendered above


# -------------------------------------------------------------------- LangChain
def test_langchain_structured_output_and_bound_tools(server, monkeypatch) -> None:
    from langchain_openai import ChatOpenAI

    for var in ("LANGCHAIN_TRACING_V2", "LANGSMITH_TRACING", "OPENAI_BASE_URL"):
        monkeypatch.delenv(var, raising=False)  # no tracing upload: only the local server

    llm = ChatOpenAI(
        base_url=server.url + "/v1", api_key=KEY, model=MODEL, temperature=0,
        max_tokens=80, max_retries=0,
    )  # fmt: skip
    structured = llm.with_structured_output(City)
    city = structured.invoke("Give the name, country and population in millions of Rome.")
    assert isinstance(city, City)
    chunks = list(structured.stream("Give the name, country and population in millions of Oslo."))
    assert isinstance(chunks[-1], City)

    def get_weather(city: str, unit: str) -> str:
        """Get the current weather in a city (unit: celsius or fahrenheit)."""
        return "sunny"

    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Rome?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    assert set(message.tool_calls[0]["args"]) == {"city", "unit"}
    total = None
    for chunk in bound.stream("What is the weather in Paris?"):
        total = chunk if total is None else total + chunk
    assert [c["name"] for c in total.tool_calls] == ["get_weather"]
    assert set(total.tool_calls[0]["args"]) == {"city", "unit"}


# ------------------------------------------------------------------- bad inputs
BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}},
            }
        },  # fmt: skip
        "response_format.json_schema.schema",
        "strin",
    ),
    ({"guided_json": {"$ref": "#/$defs/Nowhere"}}, "guided_json", "Nowhere"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex", "regex"),
    ({"guided_regex": "(?<=a)b"}, "guided_regex", "look-around"),
    (
        {"structured_outputs": {"grammar": 'root ::= a\na ::= "x" a'}},
        "structured_outputs.grammar",
        "cannot match anything",
    ),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "nope",
    ),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "grammar"),
]


@pytest.mark.parametrize(("extra", "param", "message"), BAD)
def test_bad_constraints_are_400s_naming_them(server, extra, param, message) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": ask("hi"), "max_tokens": 4} | extra
    for stream in (False, True):
        r = httpx.post(
            server.url + "/v1/chat/completions", json=body | {"stream": stream}, headers=headers
        )
        err = assert_openai_error(r, 400, param)
        assert message in err["message"], err
    good = {"model": MODEL, "messages": ask("hi"), "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=good, headers=headers)
    assert r.status_code == 200  # the server keeps serving


def test_fields_that_change_nothing_are_accepted(server, client) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ask("hi"), max_tokens=2, store=False, metadata={"run": "7"},
        service_tier="auto", user="u1", parallel_tool_calls=True,
        extra_body={"prompt_cache_key": "k", "safety_identifier": "s"},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "length"
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": ask("hi"), "modalities": ["audio"]}
    err = assert_openai_error(
        httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers), 400
    )
    assert err["param"] == "modalities" and "audio" in err["message"]


# ----------------------------------------------------------------------- docs/tools.md
def readme_blocks(language: str) -> list[str]:
    """Code blocks of docs/tools.md (structured output, tools and reasoning)."""
    return re.findall(rf"```{language}\n(.*?)```", TOOLS_DOC.read_text(), flags=re.S)


def test_readme_examples_run_verbatim(server) -> None:
    env = dict(os.environ, MLXSERVE_API_KEY=KEY)
    curls = [b for b in readme_blocks("bash") if b.startswith("curl")]
    assert curls
    for block in curls:
        cmd = block.strip().replace("localhost:8000", f"localhost:{server.port}")
        out = subprocess.run(
            ["bash", "-c", "set -eo pipefail; " + cmd + " --fail-with-body -sS"],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, (block, out.stdout, out.stderr)
        assert json.loads(out.stdout)["choices"][0]["finish_reason"] in ("stop", "tool_calls")
    examples = readme_blocks("python")
    assert examples
    for example in examples:
        code = example.replace("localhost:8000", f"localhost:{server.port}")
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
        )
        assert out.returncode == 0, (example, out.stderr)
        assert out.stdout.strip(), example


# --------------------------------------------- the same engine, preempted (Python API)
def test_constraints_hold_when_the_pool_is_so_small_that_requests_are_preempted() -> None:
    from mlxserve import LLM, SamplingParams
    from mlxserve.sampling_params import StructuredOutputsParams

    # 40 blocks of 4 tokens (one is the null block) for 8 sequences of up to ~150 tokens:
    # they cannot all stay, so running ones are preempted as their outputs grow.
    llm = LLM(max_model_len=156, num_blocks=40, block_size=4, enable_prefix_caching=False)
    constraints = {
        "json_schema": StructuredOutputsParams(json=PERSON),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICES),
        "grammar": StructuredOutputsParams(grammar=GRAMMAR),
    }
    kinds = list(constraints)
    conversations = [ask(KINDS[k][1]) for k in kinds]
    params = [
        SamplingParams(n=1 + 2 * (i % 2), seed=i, max_tokens=100, structured_outputs=constraints[k])
        for i, k in enumerate(kinds)
    ]
    outs = llm.chat(conversations, params, use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > 0
    for kind, out in zip(kinds, outs, strict=True):
        for c in out.outputs:
            assert c.finish_reason == "stop", (kind, c.text)
            check(kind, c.text)
