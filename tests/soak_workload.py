"""The soak's request mix: Calls drawn from a seeded generator.

A Call is one API request: completions or chat, streamed or not, sometimes n=2,
logprobs, stop strings, a usage chunk, a long shared system prompt, or a planned client
disconnect; or a /tokenize. soak_client.run_call sends it and checks the response;
checks that need several responses are in soak_checks.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

# A long system prompt shared by a share of the requests: their common prefix (~230
# tokens, 14+ KV blocks) is computed once and then hit in the prefix cache.
SYSTEM = " ".join(
    [
        "You are a patient assistant for a small public library in a coastal town.",
        "Answer in one short sentence, in plain English, without lists or headings.",
        "If a question is about opening hours, say the library opens at nine and closes",
        "at six on weekdays, and at noon on Saturdays; it is closed on Sundays.",
        "If a question is about borrowing, say that a card is free for residents, that",
        "up to eight books may be borrowed for three weeks, and that renewals can be made",
        "at the desk or by phone. If a question is about events, mention the reading club",
        "on Tuesday evenings and the children's story hour on Saturday mornings.",
        "Never invent a fact you were not given here; when you do not know, say so and",
        "suggest asking a librarian at the front desk. Be warm but brief, and do not",
        "repeat the question. Spell out numbers below ten. Do not use emoji, markdown or",
        "quotation marks. Keep every answer under twenty words, and end it with a full stop.",
    ]
)
QUESTIONS = [
    "What is the capital of France?",
    "Name a colour of the sky.",
    "How many legs does a spider have?",
    "What do bees make?",
    "When does the library open?",
    "Can I borrow ten books?",
    "What is two plus two?",
    "Which animal says moo?",
    "Is the library open on Sunday?",
    "What is water made of?",
    "Name a fruit that is yellow.",
    "What season comes after winter?",
]
COMPLETION_PROMPTS = [
    "The capital of France is",
    "My favourite colour is",
    "Once upon a time, there was",
    "The best way to learn a language is",
    "In the morning I usually",
    "The three primary colours are",
    "A good book should",
    "The ocean is",
    "def fibonacci(n):",
    "Water boils at",
    "The tallest mountain in the world is",
    "My cat likes to",
]
STOPS = [[".", "\n"], [" is"], [","], ["the", "a"]]
MAX_TOKENS = 16  # small: the CPU runs ~60 tokens/s for all clients together
SEEDS = [1, 2, 3]


@dataclass
class Call:
    """One request of the soak, fully determined by the generator that drew it."""

    kind: str  # "chat", "completion" or "tokenize"
    stream: bool = False
    body: dict[str, Any] = field(default_factory=dict)
    prompt_key: tuple = ()  # identifies the prompt (same key, same prompt tokens)
    output_key: tuple | None = None  # greedy / seeded: same key, same answer
    n: int = 1
    max_tokens: int = 0
    stop: list[str] | None = None
    logprobs: bool = False
    include_usage: bool = False
    disconnect_after: int | None = None  # streamed: leave after this many events
    cancel_after: float | None = None  # not streamed: leave after this many seconds

    @property
    def path(self) -> str:
        """The endpoint of this call."""
        return {
            "chat": "/v1/chat/completions",
            "completion": "/v1/completions",
            "tokenize": "/tokenize",
        }[self.kind]


def draw_call(rng: random.Random, model: str, disconnect_rate: float, shared_rate: float) -> Call:
    """One call of the mix: 35% chat streams, 15% chat, 25% completion streams,
    15% completions, 10% /tokenize."""
    kind, stream = rng.choices(
        [("chat", True), ("chat", False), ("completion", True), ("completion", False)]
        + [("tokenize", False)],
        weights=[35, 15, 25, 15, 10],
    )[0]
    shared = rng.random() < shared_rate
    if kind == "tokenize":
        return _draw_tokenize(rng, model, shared)
    if kind == "chat":
        q = rng.randrange(len(QUESTIONS))
        messages = [{"role": "user", "content": QUESTIONS[q]}]
        if shared:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        body: dict[str, Any] = {"model": model, "messages": messages}
        prompt_key: tuple = ("chat", shared, q)
    else:
        p = rng.randrange(len(COMPLETION_PROMPTS))
        body = {"model": model, "prompt": completion_prompt(p, shared)}
        prompt_key = ("text", shared, p)
    call = Call(kind, stream, body, prompt_key)
    # Greedy or seeded calls draw their length and stops from the prompt, so that equal
    # keys recur and their answers can be compared; unseeded sampling varies freely.
    mode = rng.choices(["greedy", "seeded", "random"], weights=[50, 20, 30])[0]
    salt = prompt_key[2] + 5 * shared
    call.max_tokens = 4 + 6 * (salt % 3) if mode != "random" else rng.randint(1, MAX_TOKENS)
    use_stop = (salt % 4 == 0) if mode != "random" else rng.random() < 0.2
    call.stop = STOPS[(salt // 4) % len(STOPS)] if use_stop else None
    call.n = 2 if rng.random() < 0.15 else 1
    call.logprobs = rng.random() < 0.2
    body |= {"max_tokens": call.max_tokens, "n": call.n}
    if call.stop:
        body["stop"] = call.stop
    if mode == "greedy":
        body["temperature"] = 0.0
    else:
        body |= {"temperature": 0.8, "top_p": 0.95}
    if mode == "seeded":
        body["seed"] = rng.choice(SEEDS)
    if mode != "random":
        sampling = (body["temperature"], body.get("seed"), call.max_tokens, tuple(call.stop or ()))
        # Greedy samples are all the same answer; seeded ones depend on n (one seed each).
        call.output_key = (*prompt_key, *sampling, call.n if mode == "seeded" else 0)
    if call.logprobs:
        body |= {"logprobs": True, "top_logprobs": 2} if kind == "chat" else {"logprobs": 2}
    if stream:
        body["stream"] = True
        call.include_usage = rng.random() < 0.5
        if call.include_usage:
            body["stream_options"] = {"include_usage": True}
    if rng.random() < disconnect_rate:
        if stream:
            call.disconnect_after = rng.randint(1, 4)
        else:
            call.cancel_after = rng.uniform(0.05, 3.0)
    return call


def heaviest_call(index: int, model: str) -> Call:
    """The largest call of the mix (longest prompt, n=2, logprobs, most tokens): a burst of
    these drives the server's step memory to its high-water mark at once."""
    question = QUESTIONS[index % len(QUESTIONS)]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "n": 2,
        "temperature": 0.8,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return Call(
        "chat",
        True,
        body,
        ("chat", True, index % len(QUESTIONS)),
        n=2,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        include_usage=True,
    )


def completion_prompt(index: int, shared: bool) -> str:
    """Completion prompt ``index``, after the shared system text when ``shared``."""
    prompt = COMPLETION_PROMPTS[index]
    return f"{SYSTEM}\n\nContinue: {prompt}" if shared else prompt


def _draw_tokenize(rng: random.Random, model: str, shared: bool) -> Call:
    if rng.random() < 0.5:
        p = rng.randrange(len(COMPLETION_PROMPTS))
        body = {"model": model, "prompt": completion_prompt(p, shared)}
        return Call("tokenize", body=body, prompt_key=("text", shared, p))
    q = rng.randrange(len(QUESTIONS))
    messages = [{"role": "user", "content": QUESTIONS[q]}]
    if shared:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    return Call(
        "tokenize", body={"model": model, "messages": messages}, prompt_key=("chat", shared, q)
    )
