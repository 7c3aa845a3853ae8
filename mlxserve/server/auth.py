"""The API key check: a 401 in the shape of the API that owns the path."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from mlxserve.server.api import API, owner
from mlxserve.server.errors import APIError


class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``) holds one of the
    keys (constant-time), on every path an API owns except its open ones.

    Health, version, metrics and the web page stay open (load balancers, Prometheus, and
    the page asks for the key itself), as in vLLM.
    """

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], apis: Sequence[API]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.apis = list(apis)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = owner(self.apis, scope["path"]) if scope["type"] == "http" else None
        if api is None or scope.get("method") == "OPTIONS" or scope["path"] in api.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        # Anthropic's clients send the key as x-api-key instead.
        x_api_key = headers.get(b"x-api-key")
        ok = False
        for key in self.keys:  # no early exit: the time does not depend on which key matched
            ok |= hmac.compare_digest(token.strip(), key) and scheme.lower() == b"bearer"
            if x_api_key is not None:
                ok |= hmac.compare_digest(x_api_key.strip(), key)
        if not ok:
            message = f"invalid or missing API key: {api.auth_hint}"
            response = api.error_response(APIError(401, message, code="invalid_api_key"))
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
