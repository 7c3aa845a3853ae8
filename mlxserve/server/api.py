"""An API the server speaks, as one record: API (its routes, bodies, paths, error shape).

Each API module (openai_api, anthropic, responses, ollama) exports one ``API``; the app
(server/app.py) lists them in ``APIS`` and builds itself from the records: the routes,
the request bodies in /openapi.json, the paths that need the API key, and the shape of
the errors (a 401 from the key check included) under each API's paths. Adding an API is
its module plus one line in ``APIS``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastapi import FastAPI
from pydantic import BaseModel

from mlxserve.server.errors import ErrorShape, error_response
from mlxserve.server.serving import Serving

# How a 401 tells an OpenAI-style client to authenticate.
BEARER_HINT = "send the header 'Authorization: Bearer <key>'"


@dataclass(frozen=True)
class API:
    """One HTTP API: what the app needs to serve it."""

    name: str
    # Registers the routes: (app, the server's models, the request body limit in bytes).
    add_routes: Callable[[FastAPI, Serving, int], None]
    # Paths it owns (prefixes): they need the API key when one is set, and errors under
    # them leave in ``error_response``'s shape. The longest matching prefix owns a path.
    prefixes: tuple[str, ...]
    # Request bodies the routes parse themselves, for /openapi.json's schemas.
    bodies: tuple[type[BaseModel], ...] = ()
    # Paths under ``prefixes`` that stay open (like /version).
    open_paths: tuple[str, ...] = ()
    # An APIError as this API's clients expect it (OpenAI's {"error": {...}} by default).
    error_response: ErrorShape = error_response
    # The 401's advice, after "invalid or missing API key: ".
    auth_hint: str = BEARER_HINT

    def owns(self, path: str) -> int:
        """The length of the longest of its prefixes ``path`` starts with (0: none)."""
        return max((len(p) for p in self.prefixes if path.startswith(p)), default=0)


def owner(apis: Sequence[API], path: str) -> API | None:
    """The API a path belongs to (the longest matching prefix), None for the server's own
    paths (/health, /metrics, the web page...)."""
    best, length = None, 0
    for api in apis:
        n = api.owns(path)
        if n > length:
            best, length = api, n
    return best
