"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

A 5xx (and a 413, whose body may be left unread) also closes the connection
(``Connection: close``): after an internal failure the client must not reuse it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("mlxserve.server")

# OpenAI's error "type" per status.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error a handler returns to the client (status, message, the offending param)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        """The JSON body of this error."""
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None) -> APIError:
    """400 for an invalid parameter (the message names it)."""
    return APIError(400, message, param=param)


def error_body(
    message: str, type: str, param: str | None = None, code: str | int | None = None
) -> dict:
    """{"error": {"message", "type", "param", "code"}}."""
    # Text from the request (a field name, a value) may hold what UTF-8 cannot encode.
    message = _encodable(message)
    param = _encodable(param) if param is not None else None
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def closing_headers(status: int, headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """``headers`` plus ``Connection: close`` for a status after which the connection ends."""
    if status >= 500 or status == 413:
        return (headers or {}) | {"Connection": "close"}
    return headers


def error_response(error: APIError) -> JSONResponse:
    """The error as a JSON response with its status."""
    return JSONResponse(
        error.body(), status_code=error.status, headers=closing_headers(error.status)
    )


def validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """A pydantic error as a 400 naming every bad field; unknown fields are 'unsupported'."""
    unsupported: list[str] = []
    invalid: dict[str, list[str]] = {}  # field -> messages (one per member of a union)
    for err in e.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # Unions add the tried type to the location ("prompt.str"); keep the field path.
        loc = [x for x in loc if x not in _UNION_TAGS and not x.startswith(("list[", "dict["))]
        name = ".".join(loc) or "body"
        if err.get("type") == "extra_forbidden":
            unsupported.append(name)
        else:
            message = str(err.get("msg"))
            if str(err.get("type")).endswith("_type") and "input" in err:  # strict types
                message += f" (got {_json_type(err['input'])})"
            invalid.setdefault(name, []).append(message)
    parts = [f"unsupported field {n!r}: mlxserve does not implement it" for n in unsupported]
    for name, messages in invalid.items():
        parts.append(f"invalid value for {name!r}: {' or '.join(dict.fromkeys(messages))}")
    params = unsupported + list(invalid)
    return bad_request("; ".join(parts), param=params[0] if params else None)


def _json_type(value: object) -> str:
    for kind, name in _JSON_TYPES:
        if isinstance(value, kind):
            return name
    return type(value).__name__


# bool before int: True is an int to Python, a boolean to JSON.
_JSON_TYPES = (
    (bool, "a boolean"),
    (str, "a string"),
    (int, "an integer"),
    (float, "a decimal number"),
    (list, "an array"),
    (dict, "an object"),
    (type(None), "null"),
)
_UNION_TAGS = {"str", "int", "float", "bool", "none", "function-after", "literal['text']"}


ErrorShape = Callable[[APIError], JSONResponse]


def add_error_shape(app: FastAPI, prefix: str, shape: ErrorShape) -> None:
    """Errors the framework raises for paths under ``prefix`` (404, 405...) leave in
    ``shape`` (an API's own error response) rather than OpenAI's."""
    app.state.error_shapes = [*getattr(app.state, "error_shapes", []), (prefix, shape)]


def _shape_of(request: Request) -> ErrorShape:
    """The shape registered for the longest prefix of the path (OpenAI's if none)."""
    path = request.url.path
    found, length = error_response, -1
    for prefix, shape in getattr(request.app.state, "error_shapes", []):
        if path.startswith(prefix) and len(prefix) > length:
            found, length = shape, len(prefix)
    return found


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the server as an OpenAI-shaped body (or, under a prefix that
    another API registered with add_error_shape, in that API's shape)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _shape_of(request)(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(e.status_code).phrase
        except ValueError:
            phrase = "error"
        message = e.detail if isinstance(e.detail, str) else phrase
        response = _shape_of(request)(APIError(e.status_code, message))
        response.headers.update(getattr(e, "headers", None) or {})  # e.g. 405's Allow
        return response

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error while handling a request")
        message = f"internal server error: {type(e).__name__}: {e}"
        return _shape_of(request)(APIError(500, message, type="internal_error"))
