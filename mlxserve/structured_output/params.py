"""StructuredOutputsParams: what a request's output must match (vLLM's names and shape)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from mlxserve.exceptions import ParameterError

# The constraint kinds, exactly one of which a request sets.
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM fields mlxserve does not implement: refused by name rather than ignored.
UNSUPPORTED = ("structural_tag",)


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output: a JSON schema, any JSON object, a regex, a choice
    among strings, or a grammar (Lark, or GBNF as llama.cpp writes it).

    Exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` is set.
    ``json`` is a JSON schema as a dict, a JSON string, or a pydantic model class. The
    options shape JSON output: ``disable_any_whitespace`` (compact, no free whitespace),
    ``disable_additional_properties`` (objects without ``additionalProperties`` get
    ``false``), ``whitespace_pattern`` (a regex for the whitespace between two tokens;
    default: up to 64 spaces, tabs and newlines).
    Whether the schema or grammar is supported is checked when the request is added
    (a ParameterError naming the problem), since that needs the model's tokenizer.
    """

    json: str | dict | Any | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            self.json = _schema_of_model(self.json)
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        for name in UNSUPPORTED:
            if getattr(self, name) is not None:
                raise ParameterError(
                    f"structured_outputs.{name} is not supported; use json, regex, choice, "
                    "grammar or json_object",
                    parameter=f"structured_outputs.{name}",
                )
        if len(given) != 1:
            raise ParameterError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(given) if given else 'none'}",
                parameter="structured_outputs",
            )
        _check_types(self)

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> dict | None:
        """The JSON schema as a dict (json_object: any object), None for other kinds."""
        if self.json_object:
            return {"type": "object"}
        if isinstance(self.json, str):
            try:
                value = json.loads(self.json)
            except ValueError as e:
                raise ParameterError(
                    f"structured_outputs.json is not valid JSON: {e}",
                    parameter="structured_outputs.json",
                ) from None
            if not isinstance(value, (dict, bool)):
                raise ParameterError(
                    "structured_outputs.json must be a JSON schema object, got "
                    f"{type(value).__name__}",
                    parameter="structured_outputs.json",
                )
            if value is False:
                raise ParameterError(
                    "structured_outputs.json is the schema false, which no output matches",
                    parameter="structured_outputs.json",
                )
            return {} if value is True else value
        return self.json

    def cache_key(self) -> str:
        """A string equal for equal constraints (schemas compared as canonical JSON)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.kind in ("json", "json_object"):
            values["json"] = self.schema
        return json.dumps(values, sort_keys=True, default=str)


def _schema_of_model(model: Any) -> dict:
    """The JSON schema of a pydantic model class (what ``json=Model`` means)."""
    to_schema = getattr(model, "model_json_schema", None)
    if not callable(to_schema):
        raise ParameterError(
            "structured_outputs.json must be a JSON schema (dict or JSON string) or a "
            f"pydantic model class, got {type(model).__name__}",
            parameter="structured_outputs.json",
        )
    return to_schema()


def _check_types(p: StructuredOutputsParams) -> None:
    def bad(name: str, want: str, value: object) -> ParameterError:
        return ParameterError(
            f"structured_outputs.{name} must be {want}, got {type(value).__name__}",
            parameter=f"structured_outputs.{name}",
        )

    for name in ("regex", "grammar", "whitespace_pattern"):
        value = getattr(p, name)
        if value is not None and not isinstance(value, str):
            raise bad(name, "a string", value)
    if p.grammar is not None and not p.grammar.strip():
        raise ParameterError(
            "structured_outputs.grammar must not be empty", parameter="structured_outputs.grammar"
        )
    if p.choice is not None:
        if not isinstance(p.choice, (list, tuple)) or not all(isinstance(c, str) for c in p.choice):
            raise bad("choice", "a list of strings", p.choice)
        if not p.choice:
            raise ParameterError(
                "structured_outputs.choice must list at least one string",
                parameter="structured_outputs.choice",
            )
        p.choice = list(p.choice)
    for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
        value = getattr(p, name)
        if value is not None and not isinstance(value, bool):
            raise bad(name, "a boolean", value)
