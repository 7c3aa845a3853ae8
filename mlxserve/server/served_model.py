"""One model as the APIs see it (ServedModel), and how to serve one (ModelSpec).

A ServedModel is a running engine's model under the name a request asked for: its
AsyncLLM, what the engine says about it (ModelInfo), its chat features and sampling
defaults. A ModelSpec is a model the server can serve before it is loaded: its names and
its engine config. Serving (server/serving.py) maps names to them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mlxserve.config import EngineConfig
from mlxserve.engine.async_llm import AsyncLLM
from mlxserve.engine.model_info import ModelInfo
from mlxserve.server.chat_tools import ChatFeatures
from mlxserve.server.errors import bad_request
from mlxserve.server.formatting import TokenText


@dataclass(frozen=True)
class ServedModel:
    """One model as the APIs see it, under the name a request asked for (``name``)."""

    name: str  # the served name to report back
    names: tuple[str, ...]  # every name it is served under
    llm: AsyncLLM
    info: ModelInfo  # what the engine says about the model (limits, size, facts)
    features: ChatFeatures  # its tool-call format and reasoning parser
    # The model's sampling defaults for fields a request leaves out (generation_config).
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    root: str | None = None  # its name or repo id (never a local path), for /v1/models
    token_text: TokenText | None = field(default=None, compare=False, repr=False)

    @property
    def tokenizer(self) -> Any:
        return self.info.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def named(self, name: str) -> ServedModel:
        """This model, reported under ``name`` (one of ``names``)."""
        return self if name == self.name else dataclasses.replace(self, name=name)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """400 unless every id is in the model's vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"{param} holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}",
                param,
            )


def make_served_model(
    llm: AsyncLLM,
    names: tuple[str, ...],
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    sampling_defaults: dict[str, float | int] | None = None,
    root: str | None = None,
    prompt_normalization: tuple[str, ...] = (),
) -> ServedModel:
    """A running engine's model under ``names`` (the first is the default's report name)."""
    info = llm.describe()
    return ServedModel(
        name=names[0],
        names=tuple(names),
        llm=llm,
        info=info,
        features=ChatFeatures(
            info.tokenizer, tool_call_parser, reasoning_parser, prompt_normalization
        ),
        sampling_defaults=dict(sampling_defaults or {}),
        root=root,
        token_text=TokenText(info.tokenizer),
    )


@dataclass(frozen=True)
class ModelSpec:
    """A model the server can serve: the names clients use and what the loader loads."""

    names: tuple[str, ...]  # the first is the name it reports
    config: EngineConfig | None = None  # config.model: a repo id, directory or .gguf
    root: str | None = None  # its name or repo id (never a local path), for /v1/models
    # The model's sampling defaults (None: the model's own generation config).
    sampling_defaults: dict[str, float | int] | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    prompt_normalization: tuple[str, ...] = ()
    # Its name in the Hugging Face cache (`mlxserve list`), when its files are there:
    # Ollama's /api/delete deletes them.
    cache_name: str | None = None
