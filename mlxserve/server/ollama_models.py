"""Ollama's model management: pull, delete, copy, keep_alive.

A server of several models (server/serving.py) unloads a model ``keep_alive`` after its
last request (0: at once, negative: never), as Ollama does, and manages its models:

- ``POST /api/pull`` of a model it does not serve downloads it from the hub (Ollama's status
  lines, each file's progress among them) and serves it under the name pulled;
- ``DELETE /api/delete`` stops serving a model and deletes its files from the Hugging Face
  cache (a model given by path keeps its files; the default model is never deleted);
- ``POST /api/copy`` serves a model under one more name (for the server's life).

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

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from mlxserve.loader import catalog, hub
from mlxserve.loader.catalog import LocalModel
from mlxserve.server.errors import APIError, bad_request
from mlxserve.server.keep_alive import parse_keep_alive
from mlxserve.server.served_model import ModelSpec, ServedModel
from mlxserve.server.serving import Serving

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


def describe_spec(spec: ModelSpec) -> LocalModel | None:
    """A servable model's files as `mlxserve list` describes them (headers only), when it
    is a local directory or .gguf file; None otherwise or when they cannot be read."""
    path = spec.config.model if spec.config is not None else None
    if not path or not Path(path).expanduser().exists():
        return None
    try:
        return catalog.describe(Path(path).expanduser(), spec.names[0])
    except (ValueError, OSError):
        return None


def details_of_spec(spec: ModelSpec) -> catalog.ModelDetails | None:
    """:func:`describe_spec`'s model with its details (parameters, template, defaults)."""
    local = describe_spec(spec)
    if local is None:
        return None
    try:
        return catalog.details(local)
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

    async def pull(self, body: Any) -> AsyncIterator[dict[str, Any]]:
        """A pull's status lines, Ollama's: a served model is here already ("success"); a
        server of several models downloads another from the hub (each file's progress),
        then serves it under the name pulled. 404 when this server adds no models."""
        name = model_of(body)
        if self._served(name):
            yield {"status": "success"}
            return
        if self.serving.make_spec is None:
            raise APIError(
                404,
                f"{self._one_model()}, and does not download models: to serve {name!r}, start "
                f"`mlxserve serve {name}` (a Hugging Face repo id, a local directory or a "
                ".gguf file), or serve several models",
            )
        try:
            repo_id, filename, quant = hub.parse_pull_name(name.removesuffix(":latest"))
        except ValueError as e:
            raise bad_request(str(e), "model") from None
        yield {"status": "pulling manifest"}
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def progress(file: str, done: int, total: int | None) -> None:  # a worker thread
            loop.call_soon_threadsafe(events.put_nowait, (file, done, total))

        def download() -> Path:
            return hub.pull(repo_id, filename, quant, progress=progress)

        task = asyncio.ensure_future(asyncio.to_thread(download))
        task.add_done_callback(lambda _: events.put_nowait(None))  # after every progress
        shown: dict[str, int] = {}
        while (event := await events.get()) is not None:
            file, done, total = event
            if total and done < total and done - shown.get(file, -total) < total // 100:
                continue  # at most a line per percent of a file
            shown[file] = done
            yield {"status": f"pulling {file}", "digest": file, "total": total or done} | {
                "completed": done
            }
        try:
            path = task.result()
        except ValueError as e:
            raise APIError(500, f"pull {name!r}: {e}") from None
        yield {"status": "verifying sha256 digest"}
        cache_name = hub.cache_name(repo_id, path)
        served_name = name.removesuffix(":latest")
        if not self._served(served_name):
            self.serving.add(self.serving.make_spec(served_name, str(path), cache_name))
            logger.info("pulled %s: serving it as %r", cache_name, served_name)
        yield {"status": "writing manifest"}
        yield {"status": "success"}

    async def delete(self, body: Any) -> None:
        """Stop serving a model and delete its files from the Hugging Face cache (a server
        of several models); 404 for a model this server does not serve. A one-model server
        refuses (400)."""
        name = model_of(body)
        if not self._served(name):
            raise APIError(404, f"model {name!r} not found ({self._one_model()})")
        name = name if name in self.served_names else name.removesuffix(":latest")
        if self.serving.make_spec is None:
            raise bad_request(
                f"{self._one_model()} and does not delete it; stop the server to let it go "
                "(its files stay in the Hugging Face cache or where you put them)",
                "model",
            )
        try:
            spec = await self.serving.remove(name)
        except ValueError as e:
            raise bad_request(f"cannot delete {name!r}: {e}", "model") from None
        if spec.cache_name is None:
            logger.info("deleted %r: no longer served (its files stay where they are)", name)
            return
        if any(s.cache_name == spec.cache_name for s in self.serving.specs):
            return  # another name serves the same files
        freed = await asyncio.to_thread(catalog.remove, spec.cache_name)
        logger.info("deleted %r: %s, %d bytes freed", name, spec.cache_name, freed)

    def copy(self, body: Any) -> None:
        """Serve a model under another name too (Ollama's copy; for this server's life)."""
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        source, destination = body.get("source"), body.get("destination")
        for field, value in (("source", source), ("destination", destination)):
            if not isinstance(value, str) or not value:
                raise bad_request(f"{field} is required", field)
        if not self._served(source):
            raise APIError(404, f"model {source!r} not found ({self._one_model()})")
        source = source if source in self.served_names else source.removesuffix(":latest")
        destination = destination.removesuffix(":latest")
        if destination in self.served_names:
            raise bad_request(f"model {destination!r} exists already", "destination")
        self.serving.alias(source, destination)

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
