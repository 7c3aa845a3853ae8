"""Request bodies: read under a size limit (413), parsed as strict JSON, validated (400).

What the JSON may hold is what OpenAI's API takes: UTF-8 text, numbers that are numbers
(no NaN or Infinity, which Python's json module accepts by default, no 1e999 and no integer
of hundreds of digits), strings that are text (no lone UTF-16 surrogate such as "\\ud800",
which no tokenizer can encode) and nesting at most MAX_JSON_DEPTH levels deep. Each problem
is a 400 naming where it is in the body, never a 500 from deeper down.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from mlxserve.server.errors import APIError, bad_request, validation_error

M = TypeVar("M", bound=BaseModel)

# 4 MiB holds a prompt of about a million tokens as text (or ~600k as token ids), more than
# any context the server can hold, while keeping what one request can make the server parse
# and hold in memory small (README "Limits").
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
MAX_JSON_DEPTH = 32  # a request body is an object of fields: a few levels deep at most
MAX_INTEGER_DIGITS = 40  # every integer field fits in 64 bits; past this it is not a number

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class _NotANumber:
    """Stands in for a number JSON does not have (NaN, Infinity, 1e999) until it is found."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def too_large(limit: int, size: int | None = None) -> APIError:
    """413 (each API words it in its own error shape)."""
    got = f" ({size} bytes)" if size is not None else ""
    return APIError(
        413,
        f"the request body is larger than {limit} bytes{got}; "
        "the server's limit is set with --max-request-body-bytes",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to pass ``limit`` (never read whole first)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit, int(declared))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():  # chunked bodies have no Content-Length: count
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """The body as JSON; 400 for anything that is not JSON text OpenAI's API would take."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8: {e}") from None
    try:
        data = json.loads(
            text, parse_constant=_NotANumber, parse_float=_parse_float, parse_int=_parse_int
        )
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request(_too_deep()) from None
    _check_tree(data, has_surrogates=_SURROGATE_ESCAPE.search(text) is not None)
    return data


def parse_model(data: Any, model: type[M]) -> M:
    """A parsed JSON body as ``model``: 400 for a non-object, unknown fields or bad values.

    null means "not given"; so does an empty list or object for a field mlxserve does not
    implement ("tools": []): there is nothing in it to ignore.
    """
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    known = model.model_fields
    data = {
        k: v
        for k, v in data.items()
        if v is not None and (k in known or not (isinstance(v, (list, dict)) and not v))
    }
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


async def parse_body(request: Request, model: type[M], limit: int) -> M:
    """Read, parse and validate a request body as ``model``."""
    return parse_model(parse_json(await read_body(request, limit)), model)


def _parse_float(text: str) -> float | _NotANumber:
    value = float(text)
    return value if math.isfinite(value) else _NotANumber(text)


def _parse_int(text: str) -> int | _NotANumber:
    if len(text) > MAX_INTEGER_DIGITS:
        return _NotANumber(f"{text[:12]}... ({len(text)} digits)")
    return int(text)


def _too_deep(where: str | None = None) -> str:
    what = f"{where} (in the request body)" if where else "the request body"
    return f"{what} is nested too deeply: JSON may be at most {MAX_JSON_DEPTH} levels deep"


def _check_tree(data: Any, has_surrogates: bool) -> None:
    """400 naming the path of the first bad value: too deep, not a number, not text."""
    if not isinstance(data, (dict, list)):
        return  # not an object: parse_model says so
    stack: list[tuple[Any, tuple, int]] = [(data, (), 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            where = _param(path)
            raise bad_request(_too_deep(where), where)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if has_surrogates and isinstance(key, str) and not _is_text(key):
                _not_text(path + (key,))
            kind = type(value)
            if kind is dict or kind is list:
                stack.append((value, path + (key,), depth + 1))
            elif kind is _NotANumber:
                where = _param(path + (key,))
                raise bad_request(
                    f"{where} holds {value.text}: NaN, Infinity and numbers out of range are "
                    "not accepted",
                    where,
                )
            elif has_surrogates and kind is str and not _is_text(value):
                _not_text(path + (key,))


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _not_text(path: tuple) -> None:
    where = _param(path)
    raise bad_request(
        f"{where} holds a lone UTF-16 surrogate (such as \\ud800): strings must be valid "
        "Unicode text",
        where,
    )


def _param(path: tuple) -> str | None:
    """The dotted field path, as in validation errors ("messages.0.content")."""
    text = ".".join(str(p) for p in path)
    return text.encode("utf-8", "backslashreplace").decode("utf-8") or None
