"""Schemathesis over /openapi.json against a real `mlxserve serve` (the embedded SmolLM2).

Every documented operation gets generated requests, valid (positive) and invalid (negative)
by its schema; each response must not be a 5xx and must match what /openapi.json documents
(status code, content type, body schema). Bounded and reproducible: a fixed number of
examples per operation, derandomized hypothesis, generation kept to a few tokens.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.server_harness import start_server

# Examples per operation and mode: the request bodies get most; a generation costs the most.
EXAMPLES = {GenerationMode.POSITIVE: 35, GenerationMode.NEGATIVE: 25}
GENERATION_EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 20}
GET_EXAMPLES = 10
# The Anthropic, Responses and Ollama routes: fewer (their validation is shared with the above).
OTHER_API_EXAMPLES = {GenerationMode.POSITIVE: 10, GenerationMode.NEGATIVE: 8}
OTHER_API_ROUTES = {
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /v1/responses",
    "GET /v1/responses/{response_id}",
    "POST /api/chat",
    "POST /api/generate",
    "POST /api/embed",
    "POST /api/embeddings",
    "POST /api/show",
    "POST /api/pull",
    "POST /api/copy",
    "DELETE /api/delete",
    "GET /api/tags",
    "GET /api/ps",
    "GET /api/version",
}
# Where each route's generation length is, capped to MAX_TOKENS like max_tokens above.
LENGTH_FIELDS = {"/v1/messages": "max_tokens", "/v1/responses": "max_output_tokens"}
MAX_TOKENS = 2  # generated requests ask for more; each generated token costs CPU time
CHECKS = [
    not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_schema_conformance,
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    # A short context keeps each generated request cheap: longer prompts are a quick 400.
    args = ["--max-model-len", "64", "--max-num-batched-tokens", "128", "--disable-log-stats"]
    s = start_server(args, log)
    yield s
    s.stop()


def small(case: schemathesis.Case) -> None:
    """Keep a generated generation request cheap (a few sequences of a few tokens) without
    changing whether it is valid: only values past a valid small one are lowered."""
    body = case.body
    if isinstance(body, dict) and case.path in LENGTH_FIELDS:
        key = LENGTH_FIELDS[case.path]
        if type(body.get(key)) is int and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
        elif body.get(key) is None and key == "max_output_tokens":
            body[key] = 16  # OpenAI's smallest; the default is the whole context
        return
    if isinstance(body, dict) and case.path in ("/api/chat", "/api/generate"):
        if body.get("options") is None:
            body["options"] = {}
        if isinstance(body["options"], dict):
            body["options"]["num_predict"] = MAX_TOKENS  # the default is the whole context
        return
    if isinstance(body, dict) and "embed" in case.path:
        if isinstance(body.get("input"), list) and body["input"]:
            body["input"] = body["input"][:2]  # each item is a prefill: two are enough
        return
    if not isinstance(body, dict) or "completions" not in case.path:
        return
    lengths = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if not lengths:
        body["max_tokens"] = MAX_TOKENS  # not the default: 16 tokens, or the whole context
    for key, cap in [(k, MAX_TOKENS) for k in lengths] + [("n", 2), ("min_tokens", MAX_TOKENS)]:
        if type(body.get(key)) is int and body[key] > cap:
            body[key] = cap
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        body["prompt"] = prompt[:2]  # a list of prompts: two are enough


def test_schemathesis_finds_no_5xx_and_no_undocumented_response(server) -> None:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    documented = {op.label for op in operations}
    assert {
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "POST /v1/embeddings",
        "POST /tokenize",
        "POST /detokenize",
    } | OTHER_API_ROUTES <= documented
    for op in operations:
        if op.method.upper() == "POST":  # hand-parsed bodies are documented all the same
            assert op.body, f"{op.label} documents no request body"
    statuses: Counter[tuple[str, int]] = Counter()
    start = time.monotonic()
    for op in operations:
        for mode in GenerationMode.POSITIVE, GenerationMode.NEGATIVE:
            if not op.body:
                if mode is GenerationMode.NEGATIVE:
                    continue  # a GET's only input is a string in the path: nothing is invalid
                examples = GET_EXAMPLES
            elif op.label in OTHER_API_ROUTES:
                examples = OTHER_API_EXAMPLES[mode]
            else:
                costly = "completions" in op.path or "embeddings" in op.path
                examples = (GENERATION_EXAMPLES if costly else EXAMPLES)[mode]

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples,
                derandomize=True,
                database=None,
                deadline=None,
                phases=[Phase.explicit, Phase.generate],  # no shrinking: report the case as is
                suppress_health_check=list(HealthCheck),
            )
            def run(case: schemathesis.Case) -> None:
                small(case)
                response = case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)
                statuses[(case.operation.label, response.status_code)] += 1

            run()
    elapsed = time.monotonic() - start
    num_cases = sum(statuses.values())
    print(f"\nschemathesis: {num_cases} cases, {len(operations)} operations, {elapsed:.1f} s")
    for (label, status), count in sorted(statuses.items()):
        print(f"  {label} -> {status}: {count}")
    # Generation reached the model, not only validation: each POST route answered 200s.
    for label in documented:
        if label.startswith("POST"):
            assert statuses[(label, 200)] > 0, label
