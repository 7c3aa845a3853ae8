"""A silent event stream gets comment lines (a long prefill keeps the first event back for
minutes on a CPU): the official SDKs read the stream as if they were not there, and a
client that leaves while the stream waits still closes the frames behind it."""

from __future__ import annotations

import asyncio

import anthropic
import openai
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from mlxserve.server.anthropic import event
from mlxserve.server.streams import KEEPALIVE, SSEResponse, sse, with_keepalive

EVERY = 0.05  # seconds of silence before a comment; the first frame comes after 0.3 s


async def late(frames: list[str], delay: float = 0.3):
    await asyncio.sleep(delay)
    for frame in frames:
        yield frame


def chat_chunks() -> list[str]:
    base = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    deltas = [{"role": "assistant", "content": "Hel"}, {"content": "lo"}]
    frames = [sse(base | {"choices": [{"index": 0, "delta": d}]}) for d in deltas]
    end = {"index": 0, "delta": {}, "finish_reason": "stop"}
    return frames + [sse(base | {"choices": [end]}), sse("[DONE]")]


def message_events() -> list[str]:
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m"}
    message |= {"content": [], "stop_reason": None, "stop_sequence": None}
    message |= {"usage": {"input_tokens": 3, "output_tokens": 0}}
    block = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    delta = {"type": "text_delta", "text": "Hello"}
    end = {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}}
    return [
        event("message_start", {"type": "message_start", "message": message}),
        event("content_block_start", block),
        event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        event("message_delta", end | {"usage": {"output_tokens": 2}}),
        event("message_stop", {"type": "message_stop"}),
    ]


def app() -> Starlette:
    async def chat(request):
        return SSEResponse(late(chat_chunks()), keepalive_s=EVERY)

    async def messages(request):
        return SSEResponse(late(message_events()), keepalive_s=EVERY)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/messages", messages, methods=["POST"]),
        ]
    )


def test_comments_fill_the_silence_before_the_first_event() -> None:
    with TestClient(app()) as http:
        body = http.post("/v1/chat/completions", json={}).text
    head, _, rest = body.partition("data: ")
    assert head.count(KEEPALIVE) >= 2 and head == KEEPALIVE * head.count(KEEPALIVE)
    assert KEEPALIVE not in rest  # the frames themselves come as they are made


def test_the_openai_sdk_reads_through_the_comments() -> None:
    with TestClient(app()) as http:
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="x", http_client=http)
        stream = client.chat.completions.create(model="m", messages=[], stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == "Hello"


def test_the_anthropic_sdk_reads_through_the_comments() -> None:
    with TestClient(app()) as http:
        client = anthropic.Anthropic(base_url=str(http.base_url), api_key="x", http_client=http)
        with client.messages.stream(model="m", max_tokens=8, messages=[]) as stream:
            message = stream.get_final_message()
    assert message.content[0].text == "Hello" and message.stop_reason == "end_turn"


def test_leaving_mid_wait_closes_the_frames() -> None:
    closed = asyncio.Event()

    async def never():
        try:
            await asyncio.sleep(3600)
            yield "data: x\n\n"
        finally:
            closed.set()

    async def leave() -> list[str]:
        stream = with_keepalive(never(), EVERY)
        got = [await anext(stream), await anext(stream)]
        await stream.aclose()  # what SSEResponse does when the client disconnects
        return got

    got = asyncio.run(asyncio.wait_for(leave(), 10))
    assert got == [KEEPALIVE, KEEPALIVE] and closed.is_set()
