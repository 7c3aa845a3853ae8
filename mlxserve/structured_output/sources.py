"""From StructuredOutputsParams to llguidance grammar text (JSON schema, regex, Lark)."""

from __future__ import annotations

import json

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from mlxserve.exceptions import ParameterError
from mlxserve.structured_output.params import StructuredOutputsParams

# Whitespace allowed between two JSON tokens: enough for pretty-printing (a newline and
# deep indentation), bounded so that a small model cannot loop on newlines forever.
DEFAULT_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,64}"


def grammar_text(params: StructuredOutputsParams, parameter: str) -> str:
    """llguidance's grammar definition for params (JSON schema, regex, Lark...)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = json_schema_for_grammar(params.schema)
        if params.disable_additional_properties:
            schema = close_objects(schema)
        options: dict = {"whitespace_flexible": not params.disable_any_whitespace}
        if not params.disable_any_whitespace:
            options["whitespace_pattern"] = params.whitespace_pattern or DEFAULT_WHITESPACE
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except (ValueError, TypeError) as e:
            raise ParameterError(f"invalid JSON schema: {e}", parameter=parameter) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(ascii_classes(params.regex))
    lark = lark_of(params)
    assert lark is not None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def json_schema_for_grammar(schema: dict) -> dict:
    """A JSON schema as the grammar reads it: its regexes with ASCII \\d and \\w."""
    return map_schemas(schema, _ascii_patterns)


def lark_of(params: StructuredOutputsParams) -> str | None:
    """The Lark text of a choice or grammar constraint (GBNF converted), else None."""
    if params.choice is not None:
        return "start: " + " | ".join(json.dumps(c) for c in params.choice)
    if params.grammar is not None:
        try:
            return any_to_lark(params.grammar)
        except Exception as e:  # noqa: BLE001 -- the converter raises its own error types
            raise ParameterError(
                f"invalid grammar: {e}", parameter="structured_outputs.grammar"
            ) from None
    return None


# \d and \w as JSON Schema (ECMA-262) and most users mean them: ASCII. llguidance's regex
# dialect (Rust's) reads them as Unicode classes, so a small model fills a "\d{3}" with
# digits from other scripts, pieced together from byte tokens.
_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(regex: str) -> str:
    r"""``regex`` with \d, \D, \w, \W spelled as ASCII classes."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            e = regex[i + 1]
            ascii_class = _ASCII_CLASSES.get(e.lower())
            if ascii_class is None or (in_class and e.isupper()):
                out.append(c + e)  # any other escape, or a negated class inside [...]
            elif in_class:
                out.append(ascii_class)
            else:
                out.append(f"[{'^' if e.isupper() else ''}{ascii_class}]")
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            i += 1
            for lead in ("^", "]"):  # "[]..." and "[^]..." start with a literal ]
                if regex.startswith(lead, i):
                    out.append(lead)
                    i += 1
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


# Where JSON Schema keeps subschemas (other values, e.g. "enum" or "default", are data).
_SCHEMA_KEYS = frozenset(
    "items additionalProperties not if then else contains propertyNames additionalItems "
    "unevaluatedItems unevaluatedProperties".split()
)
_SCHEMA_LIST_KEYS = frozenset(("anyOf", "oneOf", "allOf", "prefixItems", "items"))
_SCHEMA_MAP_KEYS = frozenset(("properties", "patternProperties", "$defs", "definitions"))


def map_schemas(schema: object, f) -> object:
    """``schema`` with ``f`` applied to it and to every subschema, innermost first."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_MAP_KEYS and isinstance(value, dict):
            out[key] = {k: map_schemas(v, f) for k, v in value.items()}
        elif key in _SCHEMA_LIST_KEYS and isinstance(value, list):
            out[key] = [map_schemas(v, f) for v in value]
        elif key in _SCHEMA_KEYS:
            out[key] = map_schemas(value, f)
    return f(out)


def _ascii_patterns(schema: dict) -> dict:
    """ascii_classes applied to a schema's "pattern" and "patternProperties" regexes."""
    if isinstance(schema.get("pattern"), str):
        schema["pattern"] = ascii_classes(schema["pattern"])
    if isinstance(schema.get("patternProperties"), dict):
        props = schema["patternProperties"]
        schema["patternProperties"] = {ascii_classes(k): v for k, v in props.items()}
    return schema


def close_objects(schema: dict) -> dict:
    """``schema`` with ``additionalProperties: false`` wherever an object leaves it unset."""
    return map_schemas(schema, _close_object)


def _close_object(schema: dict) -> dict:
    """``additionalProperties: false`` on an object schema that does not set it."""
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def describe_error(kind: str, error: str) -> str:
    """A user-facing message for a backend error (llguidance's text, trimmed)."""
    what = {
        "json": "invalid or unsupported JSON schema",
        "json_object": "invalid JSON schema",
        "regex": "invalid regex",
        "choice": "invalid choice",
        "grammar": "invalid grammar",
    }[kind]
    return f"{what}: {error.strip()}"
