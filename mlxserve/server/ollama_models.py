"""Ollama's model management: pull, delete, keep_alive.

A server of several models (server/serving.py) unloads a model ``keep_alive`` after its
last request (0: at once, negative: never), as Ollama does.

``mlxserve serve MODEL`` with one model and no --keep-alive keeps it for the server's life,
so there is nothing to pull or delete, and nothing to unload:

- ``POST /api/pull`` of the served model succeeds at once (Ollama's last status line,
  ``{"status": "success"}``, streamed or not); of any other model it is a 404 that says
  which model the server serves and how to serve the other one.
- ``DELETE /api/delete`` is a 400 for the served model (the server does not delete the
  model it runs) and a 404 for any other, as Ollama answers for a model it does not have.
- ``keep_alive: 0`` (Ollama: unload the model after this request) keeps the model loaded,
  and forgets the prefix cache the next time no request runs, which is what can be let go
  of while the model stays; the log says so, with the number of blocks forgotten.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from mlxserve.loader.catalog import LocalModel
from mlxserve.server.errors import APIError, bad_request
from mlxserve.server.keep_alive import parse_keep_alive
from mlxserve.server.serving import ServedModel, Serving

logger = logging.getLogger("mlxserve.server")

# A Go duration that is zero ("0", "0s", "0m0s", "0.0h"), as Ollama parses keep_alive.
_ZERO_DURATION = re.compile(r"\s*(0+(\.0*)?(ns|us|µs|ms|s|m|h)?)+\s*")


def keep_alive_is_zero(value: str | int | float | None) -> bool:
    """Whether ``keep_alive`` asks for the model to be unloaded after the request."""
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, (int, float)):
        return value == 0
    return _ZERO_DURATION.fullmatch(value) is not None


def model_of(body: Any) -> str:
    """The body's ``model`` (or Ollama's older ``name``); 400 when it has none."""
    name = body.get("model") or body.get("name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request("model is required", "model")
    return name


def describe_spec(spec) -> LocalModel | None:
    """A servable model's files as `mlxserve list` describes them (headers only), when it
    is a local directory or .gguf file; None otherwise or when they cannot be read."""
    from pathlib import Path

    from mlxserve.loader import catalog

    path = spec.config.model if spec.config is not None else None
    if not path or not Path(path).expanduser().exists():
        return None
    try:
        return catalog.describe(Path(path).expanduser(), spec.names[0])
    except (ValueError, OSError):
        return None


class OllamaModels:
    """pull / delete / keep_alive over the server's models."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    @property
    def served_names(self) -> list[str]:
        return self.serving.model_names

    def _served(self, name: str) -> bool:
        return name in self.served_names or name.removesuffix(":latest") in self.served_names

    def _one_model(self) -> str:
        names = " / ".join(repr(n) for n in self.served_names)
        if len(self.serving.specs) > 1:
            return f"this mlxserve server serves the models {names}"
        return f"this mlxserve server serves one model, {names}"

    def pull(self, body: Any) -> dict[str, str]:
        """The status of a pull (the served model is here already); 404 for another."""
        name = model_of(body)
        if not self._served(name):
            raise APIError(
                404,
                f"{self._one_model()}, and does not download models: to serve {name!r}, start "
                f"`mlxserve serve {name}` (a Hugging Face repo id, a local directory or a "
                ".gguf file)",
            )
        return {"status": "success"}

    def delete(self, body: Any) -> None:
        """Refuse: 400 for the served model, 404 for any other."""
        name = model_of(body)
        if self._served(name):
            raise bad_request(
                f"{self._one_model()} and does not delete it; stop the server to let it go "
                "(its files stay in the Hugging Face cache or where you put them)",
                "model",
            )
        raise APIError(404, f"model {name!r} not found ({self._one_model()})")

    def check_keep_alive(self, value: str | int | float | None) -> None:
        """400 for a keep_alive that is not a duration (before anything runs)."""
        if value is not None:
            try:
                parse_keep_alive(value)
            except ValueError as e:
                raise bad_request(str(e), "keep_alive") from None

    def keep_alive(self, value: str | int | float | None, model: ServedModel) -> bool:
        """Act on a request's ``keep_alive`` for ``model``; True when it asked to unload (0)."""
        if self.serving.policy.unloads:
            if value is None:
                return False
            try:
                seconds = parse_keep_alive(value)
            except ValueError as e:
                raise bad_request(str(e), "keep_alive") from None
            self.serving.set_keep_alive(model, seconds)
            return seconds == 0
        if not keep_alive_is_zero(value):
            return False
        logger.info(
            "keep_alive 0 for %r: the model stays loaded (one model per server); its prefix "
            "cache is forgotten once no request runs",
            model.name,
        )
        done = model.llm.forget_cached_prefixes()
        done.add_done_callback(
            lambda f: logger.info("keep_alive 0: forgot %d cached KV blocks", f.result())
        )
        return True
