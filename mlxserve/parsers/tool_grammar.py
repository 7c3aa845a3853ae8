"""Grammars that make the model call a tool (tool_choice "required" or a named function).

One Lark grammar (llguidance's dialect: ``%json {schema}`` embeds a JSON schema) per tool
format, so a forced call is written the way the format's parser reads it, and its
arguments validate against the tool's JSON schema (objects without
``additionalProperties`` take only the properties they declare).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mlxserve.parsers.llama3 import PYTHON_TAG
from mlxserve.parsers.mistral import ARGS
from mlxserve.structured_output.sources import (
    DEFAULT_WHITESPACE,
    close_objects,
    json_schema_for_grammar,
    map_schemas,
)

# Formats whose parser reads Hermes-style JSON in <tool_call> tags (Qwen3-Coder's parser
# accepts it besides its XML).
_HERMES_LIKE = ("hermes", "qwen3_coder")


def call_grammar(
    parser: str,
    functions: list[dict[str, Any]],
    parallel: bool,
    token_id: Callable[[str], int | None] = lambda _: None,
) -> str:
    """A Lark grammar for one call (or, with ``parallel``, one or more) to one of
    ``functions`` (OpenAI function objects: name, parameters), in ``parser``'s format.

    ``token_id(marker)`` is the id of the token that spells a marker (``<tool_call>``,
    ``[TOOL_CALLS]``...) whole, if the vocabulary has one: the grammar then asks for that
    token, which is how the model writes it. llguidance keeps special tokens apart from
    text, so a quoted ``"<tool_call>"`` would never match Qwen's single special token.
    """
    repeat = "+" if parallel else ""
    if parser in _HERMES_LIKE:
        bodies = [_call_object(f, "arguments") for f in functions]
        start, end = _token("<tool_call>", token_id), _token("</tool_call>", token_id)
        return _lark(f'start: call{repeat}\ncall: {start} "\\n" body "\\n" {end} "\\n"?\n', bodies)
    if parser == "llama3_json":
        bodies = [_call_object(f, "parameters") for f in functions]
        rest = ' ("; " body)*' if parallel else ""
        tag = token_id(PYTHON_TAG)  # Llama 3.1 may open a call with it; the parser skips it
        head = f"<[{tag}]>? " if tag is not None else ""
        return _lark(f"start: {head}body{rest}\n", bodies)
    if parser == "mistral":
        marker = _token("[TOOL_CALLS]", token_id)
        args = _token(ARGS, token_id)
        names = [json.dumps(f["name"]) for f in functions]
        bodies = [_params(f) for f in functions]
        calls = " | ".join(f"{n} {args} body{i}" for i, n in enumerate(names))
        lines = [f"start: call{repeat}", f"call: {marker} ({calls})"]
        lines += [f"body{i}: {_json(b)}" for i, b in enumerate(bodies)]
        return "\n".join(lines) + "\n"
    if parser == "harmony":
        return _harmony(functions, token_id)
    raise ValueError(f"no tool-call grammar for the {parser!r} format")


def _harmony(functions: list[dict[str, Any]], token_id: Callable[[str], int | None]) -> str:
    """gpt-oss: its reasoning (an analysis message) if it wants, then one message to
    ``functions.NAME`` with the arguments as JSON. The ``<|call|>`` that ends the call is
    an end token of the request, allowed once the arguments are complete; a harmony reply
    holds one call."""
    channel, message = _token("<|channel|>", token_id), _token("<|message|>", token_id)
    end, start = _token("<|end|>", token_id), _token("<|start|>", token_id)
    constrain = _token("<|constrain|>", token_id)
    calls = " | ".join(
        f'"{f["name"]}" " " {constrain} "json" {message} body{i}' for i, f in enumerate(functions)
    )
    lines = [
        "start: analysis? call",
        f'analysis: {channel} "analysis" {message} THOUGHT {end} {start} "assistant"',
        r"THOUGHT: /(.|\n)*/",  # text: special tokens are never text to llguidance
        f'call: {channel} "commentary to=functions." ({calls})',
    ]
    lines += [f"body{i}: {_json(_params(f))}" for i, f in enumerate(functions)]
    return "\n".join(lines) + "\n"


def _lark(head: str, bodies: list[dict]) -> str:
    alternatives = " | ".join(f"body{i}" for i in range(len(bodies)))
    lines = [head + f"body: {alternatives}"]
    lines += [f"body{i}: {_json(b)}" for i, b in enumerate(bodies)]
    return "\n".join(lines) + "\n"


def _json(schema: dict) -> str:
    """An embedded JSON schema, read as a response_format schema is (whitespace, \\d)."""
    options = {"whitespace_flexible": True, "whitespace_pattern": DEFAULT_WHITESPACE}
    return f"%json {json.dumps(json_schema_for_grammar(schema) | {'x-guidance': options})}"


def _const(value: str) -> dict:
    return {"const": value}


def _object(properties: dict[str, Any]) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _call_object(function: dict[str, Any], key: str) -> dict:
    """``{"name": NAME, key: ARGUMENTS}`` as one schema. The argument schema moves one level
    down, so its definitions (``$defs``, ``definitions``) move up to the new root, where its
    ``#/$defs/...`` references look for them, and any other local reference (``#``,
    ``#/properties/...``) is rebased onto where the arguments now are."""
    params = _params(function)
    defs = {k: params.pop(k) for k in ("$defs", "definitions") if isinstance(params.get(k), dict)}
    out = _object({"name": _const(function["name"]), key: params}) | defs
    return _rebase_refs(out, f"#/properties/{key}")


def _rebase_refs(schema: dict, base: str) -> dict:
    def rebase(sub: dict) -> dict:
        ref = sub.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            if not ref.startswith(("#/$defs/", "#/definitions/")):
                sub["$ref"] = base + ref[1:]
        return sub

    return map_schemas(schema, rebase)  # type: ignore[return-value]


def _params(function: dict[str, Any]) -> dict:
    """The function's argument schema (no schema: any object). Objects hold only the
    properties they declare unless they say otherwise: a function takes the arguments it
    names, and a small model would otherwise invent more until max_tokens."""
    schema = function.get("parameters")
    return close_objects(schema) if isinstance(schema, dict) and schema else {"type": "object"}


def _token(text: str, token_id: Callable[[str], int | None]) -> str:
    """The marker as a Lark item: its token (``<[id]>``) if it is one, else its text."""
    tok = token_id(text)
    return f"<[{tok}]>" if tok is not None else json.dumps(text)
