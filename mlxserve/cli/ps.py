"""`mlxserve ps`: the models a running server has loaded (its Ollama `/api/ps`), with the
memory each takes and until when it stays loaded; a server without `/api/ps` is asked for
`/v1/models` (names only)."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from datetime import datetime, timezone
from typing import Any

from mlxserve.cli.models import human_bytes
from mlxserve.cli.serve import API_KEY_ENV_VARS

DEFAULT_URL = "http://127.0.0.1:8000"
TIMEOUT_S = 10.0


def _get(url: str, api_key: str | None) -> dict[str, Any] | None:
    """GET a JSON object; None on 404 (the server has no such endpoint)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S
        ) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        if e.code == 401:
            raise ValueError(
                f"{url} answered HTTP 401: pass the server's API key with --api-key "
                f"(or ${API_KEY_ENV_VARS[0]})"
            ) from None
        raise ValueError(f"{url} answered HTTP {e.code}") from None


def _ps_command(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    api_key = args.api_key or next(
        (os.environ[v] for v in API_KEY_ENV_VARS if os.environ.get(v)), None
    )
    try:
        ps = _get(f"{url}/api/ps", api_key)
        models = None if ps is not None else _get(f"{url}/v1/models", api_key)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ValueError(
            f"no mlxserve server answers at {url} ({reason}); start one with "
            f"`mlxserve serve MODEL`, or pass --url"
        ) from None
    if ps is not None:
        rows = [
            (
                str(m.get("name") or m.get("model")),
                human_bytes(m.get("size_vram") or m.get("size") or 0),
                str(m.get("context_length") or "-"),
                _until(str(m.get("expires_at") or "")),
            )
            for m in ps.get("models", [])
        ]
        _print_table(("NAME", "MEMORY", "CONTEXT", "UNTIL"), rows)
        return 0
    if models is None:
        raise ValueError(f"{url} has neither /api/ps nor /v1/models: is it an LLM server?")
    rows = [(str(m.get("id")), "?", "?", "?") for m in models.get("data", [])]
    _print_table(("NAME", "MEMORY", "CONTEXT", "UNTIL"), rows)
    return 0


def _until(expires_at: str, now: datetime | None = None) -> str:
    """Ollama's expires_at as `ollama ps` words it: "4 minutes from now"; a far-future one
    (the model is served for the server's life) reads "forever"."""
    try:
        when = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except ValueError:
        return expires_at or "forever"
    if when.year >= 2100:
        return "forever"
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    seconds = (when - (now or datetime.now(timezone.utc))).total_seconds()
    if seconds <= 0:
        return "now"
    for unit, size in (("hour", 3600), ("minute", 60), ("second", 1)):
        if seconds >= size or unit == "second":
            count = round(seconds / size)
            return f"{count} {unit}{'' if count == 1 else 's'} from now"
    raise AssertionError("unreachable")


def _print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print("  ".join(cells).rstrip())


def add_ps_command(subparsers: argparse._SubParsersAction) -> None:
    """Register `ps` on the mlxserve command line."""
    p = subparsers.add_parser(
        "ps", help="the models a running server has loaded", description=__doc__
    )
    p.add_argument(
        "--url", default=DEFAULT_URL, help=f"the server's base URL (default: {DEFAULT_URL})"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"the server's API key (default: ${API_KEY_ENV_VARS[0]} or ${API_KEY_ENV_VARS[1]})",
    )
    p.set_defaults(handler=_ps_command, verbose=False)
