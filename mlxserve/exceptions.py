"""Errors that carry what they are about, so every layer can report them without parsing."""

from __future__ import annotations


class ParameterError(ValueError):
    """A bad value for a named parameter (a SamplingParams field, a request field, an engine
    argument). ``parameter`` names it, so the HTTP layer reports it in OpenAI's ``param``
    without reading the message; the message itself names the value and the limit."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


class RequestFailedError(RuntimeError):
    """A request failed inside the engine (a step it was in raised because of it); the
    other requests of that step were not affected."""

    def __init__(self, message: str, request_id: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class UnsupportedModelError(ValueError):
    """An architecture (or one of its layers) mlxserve cannot run; the message says why."""
