"""The soak's checks catch what they claim to: canned responses (httpx.MockTransport),
one contract broken at a time, must fail; the well-formed one must pass."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable

import httpx
import pytest

from tests.soak_checks import consistency_failures
from tests.soak_client import Outcome, run_call
from tests.soak_workload import Call

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def chat_call(**overrides) -> Call:
    fields = {"n": 1, "max_tokens": 2, "include_usage": True, "prompt_key": ("chat", False, 0)}
    return Call("chat", body={"messages": []}, **({"stream": True} | fields | overrides))


def chunk(delta: dict, finish: str | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return HEAD | {"choices": [choice], "usage": None}


def good_events() -> list[dict]:
    """A well-formed chat stream: role chunk, two tokens, finish, usage chunk."""
    return [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo"}, "length"),
        HEAD
        | {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}},
    ]


def sse(events: list[dict | str]) -> bytes:
    return "".join(
        f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events
    ).encode()


def run(call: Call, content: bytes, status: int = 200, ctype: str = "text/event-stream") -> Outcome:
    def handler(_: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers={"content-type": ctype}, content=content)

    async def go() -> Outcome:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://soak") as http:
            return await run_call(http, call)

    return asyncio.run(go())


def test_a_well_formed_stream_passes() -> None:
    out = run(chat_call(), sse(good_events() + ["[DONE]"]))
    assert (out.status, out.error) == ("ok", "")
    assert out.texts == {0: "Hello"} and out.finish_reasons == {0: "length"}
    assert (out.prompt_tokens, out.completion_tokens) == (5, 2)


def _set(path: tuple, value) -> Callable[[list], list]:
    def mutate(events: list) -> list:
        target = events
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return events

    return mutate


BROKEN: dict[str, tuple[Callable[[list], list], str]] = {
    "no [DONE]": (lambda e: e, "without data: [DONE]"),
    "no role chunk first": (lambda e: e[1:] + ["[DONE]"], "role chunk"),
    "a chunk after finish_reason": (
        lambda e: e[:3] + [chunk({"content": "!"})] + e[3:] + ["[DONE]"],
        "after its finish_reason",
    ),
    "no finish_reason": (
        lambda e: _set((2, "choices", 0, "finish_reason"), None)(e) + ["[DONE]"],
        "never got a finish_reason",
    ),
    "unknown finish_reason": (
        lambda e: _set((2, "choices", 0, "finish_reason"), "abort")(e) + ["[DONE]"],
        "finish_reason 'abort'",
    ),
    "no usage chunk": (lambda e: e[:3] + ["[DONE]"], "no final usage chunk"),
    "usage before the end": (
        lambda e: _set((1, "usage"), e[3]["usage"])(e) + ["[DONE]"],
        "usage in chunk 1",
    ),
    "usage not adding up": (
        lambda e: _set((3, "usage", "total_tokens"), 8)(e) + ["[DONE]"],
        "does not add up",
    ),
    "more tokens than max_tokens": (
        lambda e: (
            _set((3, "usage"), {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8})(e)
            + ["[DONE]"]
        ),
        "completion_tokens 3",
    ),
    "an in-stream error": (
        lambda e: e[:2] + [{"error": {"message": "internal error"}}, "[DONE]"],
        "in-stream error",
    ),
    "an event after [DONE]": (lambda e: e + ["[DONE]", e[3]], "event after [DONE]"),
    "a second role chunk": (
        lambda e: e[:1] + [chunk({"role": "assistant", "content": "Hel"})] + e[2:] + ["[DONE]"],
        "a second role chunk",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_stream_fails(case: str) -> None:
    mutate, reason = BROKEN[case]
    out = run(chat_call(), sse(mutate(copy.deepcopy(good_events()))))
    assert out.status == "failed" and reason in out.error, out.error


def test_framing_stop_strings_http_errors_fail() -> None:
    unframed = sse(good_events() + ["[DONE]"]).replace(b"\n\n", b"\n", 1)
    assert "no blank line" in run(chat_call(), unframed).error
    out = run(chat_call(stop=["lo"]), sse(good_events() + ["[DONE]"]))
    assert "stop string 'lo'" in out.error
    out = run(chat_call(), b'{"error": {"message": "boom"}}', 500, "application/json")
    assert out.status == "failed" and "HTTP 500" in out.error


def test_a_planned_disconnect_is_aborted_not_failed() -> None:
    out = run(chat_call(disconnect_after=2), sse(good_events()[:2]))  # no [DONE]: cut short
    assert out.status == "aborted" and out.texts == {0: "Hel"}


def outcome(text: str, status: str = "ok", prompt_tokens: int = 5, **call_fields) -> Outcome:
    call = chat_call(output_key=("k",), **call_fields)
    call.body["temperature"] = 0.0
    return Outcome(
        call, status, texts={0: text}, finish_reasons={0: "length"}, prompt_tokens=prompt_tokens
    )


def test_consistency_checks_catch_disagreements() -> None:
    assert (
        consistency_failures([outcome("Hello"), outcome("Hello"), outcome("He", "aborted")]) == []
    )
    (diff,) = consistency_failures([outcome("Hello"), outcome("Help!")])
    assert "different answers" in diff
    (prefix,) = consistency_failures([outcome("Hello"), outcome("Ha", "aborted")])
    assert "not a prefix" in prefix
    (count,) = consistency_failures([outcome("Hello"), outcome("Hello", prompt_tokens=6)])
    assert "counted as [5, 6] tokens" in count


def test_unary_responses_are_checked() -> None:
    body = {
        "object": "chat.completion",
        "choices": [
            {
                "index": j,
                "message": {"role": "assistant", "content": "Hi"},
                "logprobs": None,
                "finish_reason": "length",
            }
            for j in range(2)
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
    }
    call = chat_call(n=2, include_usage=False, stream=False)
    ok = run(call, json.dumps(body).encode(), ctype="application/json")
    assert (ok.status, ok.texts) == ("ok", {0: "Hi", 1: "Hi"})
    one_choice = body | {"choices": body["choices"][:1]}
    out = run(call, json.dumps(one_choice).encode(), ctype="application/json")
    assert "choice indexes [0], n=2" in out.error
    short = body | {"usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    out = run(call, json.dumps(short).encode(), ctype="application/json")
    assert "completion_tokens 3" in out.error
