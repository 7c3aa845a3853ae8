"""Which model serves a request: Serving (the server's models) and ServedModel (one).

Every API resolves the request's ``model`` field here, with ``Serving.check_model``, and
then reads only the ServedModel it got back (its engine, tokenizer, limits, chat features
and sampling defaults). Today a server runs one model under one or more names; serving
several models is a change to this module only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mlxserve.engine.async_llm import AsyncLLM
from mlxserve.engine.model_info import ModelInfo
from mlxserve.server.chat_tools import ChatFeatures
from mlxserve.server.errors import APIError, bad_request
from mlxserve.server.formatting import TokenText
from mlxserve.server.streams import InFlight


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


class Serving:
    """The server's models and the requests in flight on them (for a graceful shutdown)."""

    def __init__(self, models: list[ServedModel]) -> None:
        assert models, "a server serves at least one model"
        self.models = models
        self.in_flight = InFlight()

    @property
    def model_names(self) -> list[str]:
        """Every served name, in order (the first is the default model's)."""
        return [n for m in self.models for n in m.names]

    @property
    def default(self) -> ServedModel:
        """The model a request that names none gets."""
        return self.models[0]

    def check_model(self, name: str | None) -> ServedModel:
        """The model serving ``name`` (the default for None), reported under that name;
        404 for a name this server does not serve."""
        if name is None:
            return self.default
        for model in self.models:
            if name in model.names:
                return model.named(name)
        raise APIError(
            404,
            f"The model {name!r} does not exist; this server serves "
            f"{', '.join(repr(n) for n in self.model_names)}",
            param="model",
            code="model_not_found",
        )

    @property
    def is_running(self) -> bool:
        """Whether every model's engine thread runs."""
        return all(m.llm.is_running for m in self.models)

    def model_or_default(self, name: str | None) -> ServedModel:
        """The model serving ``name``, or the default model for a name this server does not
        serve (routes that only count tokens and never refused an unknown name)."""
        try:
            return self.check_model(name)
        except APIError:
            return self.default

    def check_accepting(self) -> None:
        """503 once a graceful shutdown has begun."""
        if self.in_flight.is_draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
