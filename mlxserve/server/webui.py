"""The browser face: the chat page at ``/`` and offline ``/docs`` and ``/redoc``.

GET /            the chat page (mlxserve/server/ui/index.html; docs/web.md describes it)
GET /ui/...      its scripts and styles, shipped in the wheel beside this module
GET /ui/vendor/  Swagger UI and ReDoc, from the fastapi-offline package (no CDN)
GET /docs /redoc FastAPI's documentation pages, pointed at those local copies

None of these needs the API key: the page itself asks for the key when an API route
answers 401, and keeps it in the browser.
"""

from __future__ import annotations

import os
from functools import cache
from importlib.resources import files
from os import PathLike
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

UI_DIR = Path(__file__).with_name("ui")
VENDOR = "/ui/vendor"
# The page is plain HTML/CSS/JS without a build step; a stale copy after an upgrade would
# talk to the new server with old code, so the browser revalidates every time (304s).
_REVALIDATE = {"Cache-Control": "no-cache"}


def vendor_dir() -> Path:
    """fastapi-offline's bundled swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js."""
    return Path(str(files("fastapi_offline") / "static"))


def add_webui_routes(app: FastAPI) -> None:
    """Register the chat page, its assets and the offline /docs and /redoc.

    The app must be made with ``docs_url=None, redoc_url=None`` (FastAPI's own pages load
    their scripts from a CDN)."""
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(UI_DIR / "index.html", headers=_REVALIDATE)

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{VENDOR}/swagger-ui-bundle.js",
            swagger_css_url=f"{VENDOR}/swagger-ui.css",
            swagger_favicon_url="/ui/favicon.svg",
            # Swagger UI would otherwise send the spec to validator.swagger.io for a badge.
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{VENDOR}/redoc.standalone.js",
            redoc_favicon_url="/ui/favicon.svg",
            with_google_fonts=False,
        )

    @app.get(f"{VENDOR}/redoc.standalone.js", include_in_schema=False)
    async def redoc_js() -> Response:
        return Response(_offline_redoc(), media_type="text/javascript")

    # Routes before mounts, the more specific mount first: Starlette matches in order.
    app.mount(VENDOR, StaticFiles(directory=vendor_dir()), name="ui-vendor")
    app.mount("/ui", _RevalidatedFiles(directory=UI_DIR), name="ui")


@cache
def _offline_redoc() -> bytes:
    """ReDoc's script without its one network request: the Redocly logo of its "API docs by
    Redocly" line comes from a CDN (offline it fails and ReDoc hides it; here it fails
    without a request)."""
    script = (vendor_dir() / "redoc.standalone.js").read_bytes()
    return script.replace(REDOC_LOGO, b"data:,")


REDOC_LOGO = b"https://cdn.redoc.ly/redoc/logo-mini.svg"


class _RevalidatedFiles(StaticFiles):
    """StaticFiles whose responses the browser revalidates (ETag) before each use."""

    def file_response(
        self,
        full_path: PathLike[str] | str,
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(_REVALIDATE)
        return response
