"""Is a client's JSON schema a JSON schema? Checked once, at the boundary, for every API.

A tool's argument schema is only used for a grammar when a call is forced; checked here,
a malformed one (``"properties": 5``, ``"type": "nonsense"``) is a 400 naming the tool's
schema field whatever ``tool_choice`` says, rather than a grammar error on some requests
and silence on the others. The check is the jsonschema package's meta-schema validation,
in the schema's own draft (``$schema``; 2020-12 when it names none).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError

from mlxserve.server.errors import bad_request


def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not a valid JSON schema, None when it is."""
    if not isinstance(schema, dict):
        return "a JSON schema must be a JSON object"
    try:
        key = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError):
        return "a JSON schema must be JSON"
    return _problem(key)


@functools.lru_cache(maxsize=1024)  # agents send the same tools every turn
def _problem(key: str) -> str | None:
    schema = json.loads(key)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except SchemaError as e:
        where = "".join(f"[{p!r}]" for p in e.path)  # inside the schema, e.g. ['properties']
        return f"not a valid JSON schema: {e.message}" + (f" at {where}" if where else "")
    return None


def check_tool_schema(schema: Any, param: str) -> None:
    """400 naming ``param`` (e.g. ``tools.2.input_schema``) if ``schema`` is malformed."""
    problem = schema_problem(schema)
    if problem is not None:
        raise bad_request(f"invalid value for {param!r}: {problem}", param)
