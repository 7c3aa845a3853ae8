"""One soak call on the wire, and the checks every response must pass.

run_call sends a Call and returns its Outcome: "ok", "aborted" (the client left on
purpose, as planned by the Call) or "failed" with the reason: an HTTP error, a timeout,
or a response that breaks the API's contract (Malformed): SSE framing, a role chunk
first in chat streams, one finish_reason per sample and nothing after it, usage only in
the last chunk and only when asked, usage that adds up, logprob entries one per token,
no stop string in the text, data: [DONE] last.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.soak_workload import Call


@dataclass
class Outcome:
    """What happened to one Call."""

    call: Call
    status: str  # "ok", "aborted" (by plan), "cut" (at the end of the warm-up), "failed"
    error: str = ""
    texts: dict[int, str] = field(default_factory=dict)  # sample index -> text
    finish_reasons: dict[int, str] = field(default_factory=dict)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tokens: list[int] | None = None  # /tokenize
    latency: float = 0.0  # to the last byte (or to the disconnect)
    ttft: float | None = None  # streamed: to the first generated text


async def run_call(http: httpx.AsyncClient, call: Call) -> Outcome:
    """Send one call and check its response; never raises (a failure is an Outcome)."""
    start = time.monotonic()
    out = Outcome(call, "ok")
    try:
        if call.stream:
            await _streamed(http, call, out, start)
        elif call.cancel_after is not None:
            try:
                await asyncio.wait_for(_unary(http, call, out), call.cancel_after)
            except asyncio.TimeoutError:
                out.status = "aborted"
        else:
            await _unary(http, call, out)
    except Exception as e:  # noqa: BLE001 -- every failure is reported, none is raised
        out.status, out.error = "failed", f"{type(e).__name__}: {e}"[:500]
    out.latency = time.monotonic() - start
    return out


class Malformed(Exception):
    """A response that breaks the API's contract."""


def expect(condition: bool, message: str) -> None:
    """Raise Malformed(message) unless condition holds."""
    if not condition:
        raise Malformed(message)


async def _unary(http: httpx.AsyncClient, call: Call, out: Outcome) -> None:
    r = await http.post(call.path, json=call.body)
    expect(r.status_code == 200, f"HTTP {r.status_code}: {r.text[:300]}")
    body = r.json()
    if call.kind == "tokenize":
        tokens = body["tokens"]
        expect(body["count"] == len(tokens), f"count {body['count']} != {len(tokens)} tokens")
        expect(all(isinstance(t, int) and t >= 0 for t in tokens), "token ids not ints >= 0")
        out.tokens, out.prompt_tokens = tokens, len(tokens)
        return
    want = "chat.completion" if call.kind == "chat" else "text_completion"
    expect(body["object"] == want, f"object {body['object']!r}")
    indexes = [c["index"] for c in body["choices"]]
    expect(indexes == list(range(call.n)), f"choice indexes {indexes}, n={call.n}")
    lp_counts = {}
    for c in body["choices"]:
        if call.kind == "chat":
            expect(c["message"]["role"] == "assistant", f"message {c['message']}")
            text = c["message"]["content"]
            lp = c["logprobs"]
            if call.logprobs:
                lp_counts[c["index"]] = len(lp["content"])
        else:
            text, lp = c["text"], c["logprobs"]
            if call.logprobs:
                lp_counts[c["index"]] = len(lp["tokens"])
                expect(len(lp["token_logprobs"]) == len(lp["tokens"]), "logprobs lengths differ")
        expect(call.logprobs or lp is None, "logprobs not asked for but sent")
        out.texts[c["index"]] = text
        out.finish_reasons[c["index"]] = c["finish_reason"]
        check_sample(call, text, c["finish_reason"], c.get("stop_reason"))
    check_usage(call, body["usage"], out, lp_counts)


async def _streamed(http: httpx.AsyncClient, call: Call, out: Outcome, start: float) -> None:
    events: list[dict] = []
    done = False
    async with http.stream("POST", call.path, json=call.body) as r:
        if r.status_code != 200:
            await r.aread()
            raise Malformed(f"HTTP {r.status_code}: {r.text[:300]}")
        ctype = r.headers.get("content-type", "")
        expect(ctype.startswith("text/event-stream"), f"content-type {ctype!r}")
        blank_expected = False
        async for line in r.aiter_lines():
            # SSE framing: "data: <payload>" then one blank line, nothing else.
            if blank_expected:
                expect(line == "", f"no blank line after an event: {line[:200]!r}")
                blank_expected = False
                continue
            expect(line.startswith("data: "), f"not an SSE data line: {line[:200]!r}")
            expect(not done, f"event after [DONE]: {line[:200]!r}")
            blank_expected = True
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                done = True
                continue
            event = json.loads(payload)
            expect("error" not in event, f"in-stream error: {payload[:300]}")
            events.append(event)
            if out.ttft is None and _has_text(event):
                out.ttft = time.monotonic() - start
            if call.disconnect_after is not None and len(events) >= call.disconnect_after:
                out.status = "aborted"  # leaving mid-stream closes the connection
                _check_events(call, events, out, complete=False)
                return
    expect(done, "the stream ended without data: [DONE]")
    _check_events(call, events, out, complete=True)


def _has_text(event: dict) -> bool:
    for c in event.get("choices") or ():
        if c.get("text") or (c.get("delta") or {}).get("content"):
            return True
    return False


def _check_events(call: Call, events: list[dict], out: Outcome, complete: bool) -> None:
    """The events of a stream are well-formed (all of them when ``complete``)."""
    expect(bool(events) or not complete, "no events before [DONE]")
    want = "chat.completion.chunk" if call.kind == "chat" else "text_completion"
    expect(len({e["id"] for e in events}) <= 1, "chunk ids differ within one stream")
    body_events = events
    if call.kind == "chat":  # one role chunk per sample first, in index order
        roles = events[: call.n]
        for j, e in enumerate(roles):
            (c,) = e["choices"]
            ok = c["index"] == j and c["delta"] == {"role": "assistant", "content": ""}
            expect(ok and c["finish_reason"] is None, f"role chunk {j} is {e}")
        body_events = events[call.n :]
    usage = None
    if body_events and body_events[-1]["choices"] == []:
        usage = body_events[-1]["usage"]
        body_events = body_events[:-1]
    expect(usage is not None or not (complete and call.include_usage), "no final usage chunk")
    parts: dict[int, list[str]] = {}
    lp_counts: dict[int, int] = {}
    for e in events:
        expect(e["object"] == want, f"object {e['object']!r}")
        if call.include_usage:
            expect("usage" in e, "a chunk without the usage key (include_usage)")
        # Only the last chunk of a stream that asked for it has usage (a client that left
        # right after it got it: the stream is cut but that chunk is still last).
        if e.get("usage") is not None:
            last = e is events[-1] and call.include_usage and e["choices"] == []
            expect(last, f"usage in chunk {events.index(e)} of {len(events)}: {e}")
    for e in body_events:
        expect(len(e["choices"]) == 1, f"a chunk with {len(e['choices'])} choices")
        c = e["choices"][0]
        j = c["index"]
        expect(0 <= j < call.n, f"choice index {j}, n={call.n}")
        expect(j not in out.finish_reasons, f"choice {j} continues after its finish_reason")
        if call.kind == "chat":
            expect("role" not in c["delta"], "a second role chunk")
            expect(set(c["delta"]) <= {"content"}, f"delta {c['delta']}")
            text = c["delta"].get("content", "")
        else:
            text = c["text"]
        expect(isinstance(text, str), f"text {text!r}")
        lp = c["logprobs"]
        expect(call.logprobs or lp is None, "logprobs not asked for but sent")
        if call.logprobs and lp is not None:
            n_lp = len(lp["content"]) if call.kind == "chat" else len(lp["tokens"])
            lp_counts[j] = lp_counts.get(j, 0) + n_lp
        parts.setdefault(j, []).append(text)
        if c["finish_reason"] is not None:
            out.finish_reasons[j] = c["finish_reason"]
            check_sample(call, "".join(parts[j]), c["finish_reason"], c.get("stop_reason"))
    out.texts = {j: "".join(p) for j, p in parts.items()}
    missing = set(range(call.n)) - set(out.finish_reasons)
    if complete or usage is not None:
        expect(not missing, f"samples {sorted(missing)} never got a finish_reason")
    if usage is not None:
        check_usage(call, usage, out, lp_counts if call.logprobs else {})


def check_sample(call: Call, text: str, finish_reason: str | None, stop_reason: Any) -> None:
    """One finished sample: a known finish_reason, no stop string left in its text."""
    expect(finish_reason in ("stop", "length"), f"finish_reason {finish_reason!r}")
    for s in call.stop or ():
        expect(s not in text, f"stop string {s!r} in the text {text!r}")
    if isinstance(stop_reason, str):
        expect(stop_reason in (call.stop or ()), f"stop_reason {stop_reason!r}, stop={call.stop}")


def check_usage(call: Call, usage: dict, out: Outcome, lp_counts: dict[int, int]) -> None:
    """usage adds up, fits max_tokens x n, and counts the logprob entries when sent."""
    p, c = usage["prompt_tokens"], usage["completion_tokens"]
    expect(usage["total_tokens"] == p + c, f"usage does not add up: {usage}")
    expect(p > 0, f"prompt_tokens {p}")
    lengths = sum(r == "length" for r in out.finish_reasons.values())
    low = lengths * call.max_tokens + (call.n - lengths)  # a stopped sample has >= 1 token
    expect(low <= c <= call.n * call.max_tokens, f"completion_tokens {c}, {out.finish_reasons}")
    if lp_counts:
        expect(sum(lp_counts.values()) == c, f"{lp_counts} logprob entries, {c} tokens")
    out.prompt_tokens, out.completion_tokens = p, c
