"""Request fields for structured output and tools, and the constraint they ask for.

    response_format  {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    structured_outputs  vLLM's object: json, regex, choice, grammar, json_object, options
    guided_json / guided_regex / guided_choice / guided_grammar   vLLM's older extras
    tools, tool_choice ("none" | "auto" | "required" | {"type": "function", ...})

At most one of the constraint fields may be set (a second one is a 400 naming it); what
it becomes is one StructuredOutputsParams for the engine. Errors the engine finds in it
(an invalid schema, say) name the field the client used.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlxserve.exceptions import ParameterError
from mlxserve.sampling_params import StructuredOutputsParams
from mlxserve.server.errors import bad_request
from mlxserve.server.json_schemas import schema_problem

logger = logging.getLogger("mlxserve.server")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    """response_format.json_schema: a named JSON schema (strict or not, it is enforced)."""

    name: str = Field(json_schema_extra={"pattern": "^[A-Za-z0-9_-]{1,64}$"})
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """response_format: plain text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's structured_outputs object (one of json, regex, choice, grammar, json_object)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class FunctionDefinition(_Strict):
    """A tool's function: its name, what it does, its arguments' JSON schema."""

    name: str = Field(json_schema_extra={"pattern": "^[A-Za-z0-9_.-]{1,64}$"})
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _a_json_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        problem = None if schema is None else schema_problem(schema)
        if problem is not None:
            raise ValueError(problem)
        return schema


class Tool(_Strict):
    """tools[i]: a function the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """tool_choice naming one function: the model must call it."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StructuredFields(_Strict):
    """The constraint fields both generation endpoints take."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's older per-request backend choice: one backend here, the same constraint.
    guided_decoding_backend: str | None = None

    def constraint(self) -> tuple[StructuredOutputsParams | None, dict[str, str]]:
        """The constraint asked for, and the names the client gave its parts (for errors).

        400 if two fields ask for one, or the one asked for is malformed.
        """
        given = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            given.append("response_format")
        if self.structured_outputs is not None:
            given.append("structured_outputs")
        given += [
            f
            for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if getattr(self, f) is not None
        ]
        if len(given) > 1:
            raise bad_request(
                f"{given[1]} cannot be combined with {given[0]}: a request takes one "
                "output constraint",
                given[1],
            )
        if self.guided_decoding_backend is not None:
            logger.debug("guided_decoding_backend=%r ignored", self.guided_decoding_backend)
        if not given:
            return None, {}
        field = given[0]
        names = {"structured_outputs": field}
        try:
            if field == "response_format":
                assert rf is not None
                if rf.type == "json_object":
                    names["structured_outputs.json"] = "response_format"
                    return StructuredOutputsParams(json_object=True), names
                if rf.json_schema is None:
                    raise bad_request(
                        "response_format of type json_schema needs a json_schema object",
                        "response_format.json_schema",
                    )
                names["structured_outputs.json"] = "response_format.json_schema.schema"
                schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
                return StructuredOutputsParams(json=schema), names
            if field == "structured_outputs":
                so = self.structured_outputs
                assert so is not None
                values = so.model_dump(by_alias=True, exclude_none=True)
                return StructuredOutputsParams(**values), names
            kind = field.removeprefix("guided_")
            names[f"structured_outputs.{kind}"] = field
            params = StructuredOutputsParams(
                whitespace_pattern=self.guided_whitespace_pattern, **{kind: getattr(self, field)}
            )
            return params, names
        except ParameterError as e:
            param = names.get(e.parameter or "", e.parameter)
            raise bad_request(str(e), param) from None
