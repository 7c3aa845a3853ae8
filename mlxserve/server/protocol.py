"""Request bodies of the OpenAI-compatible API (pydantic), and their SamplingParams.

Field policy (docs/api-fields.md): every field of OpenAI's API is declared here and is either
honoured (it changes the output as OpenAI's does), accepted (metadata and hints that change
nothing about the output: store, metadata, prompt_cache_key, verbosity, prediction, ...) or
refused with a 400 naming it, only where ignoring it would be silently wrong (audio output,
moderation, the legacy functions). A field no OpenAI API has is a 400 that names it. Fields
set to JSON null count as absent. Types are strict, as OpenAI's: "10" is not an integer, true
is not 1, "true" is not a boolean; only a float field also takes a JSON integer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from mlxserve.exceptions import ParameterError
from mlxserve.sampling_params import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from mlxserve.server.errors import APIError, bad_request
from mlxserve.server.reasoning_effort import effort_template_kwargs
from mlxserve.server.structured import StructuredFields, Tool, ToolChoice

logger = logging.getLogger("mlxserve.server")

# Engine requests one API call may start (prompts x n): one call must not fill the queue.
MAX_SEQUENCES = MAX_N


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# Fields that change nothing about the output, accepted because clients send them
# (docs/api-fields.md); a field whose absence of effect would be silently wrong is refused.
IGNORED_FIELDS = (
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "safety_identifier",
)


def _doc(**schema: Any) -> Any:
    """A field's default plus the bounds /openapi.json shows for it.

    Documentation only (clients, fuzzers): the check itself stays in SamplingParams, which
    names the field in its 400; the numbers come from the same constants.
    """
    default = schema.pop("default", None)
    return Field(default, json_schema_extra=schema)


def _range(lo: float, hi: float, default: Any, **more: Any) -> Any:
    return _doc(default=default, minimum=lo, maximum=hi, **more)


_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": INT32_MAX}


def _integral(value: Any) -> Any:
    """A JSON number without a fractional part (``10.0``) is the integer it equals, as JSON
    Schema and vLLM read it (strict types still refuse ``"10"``, ``true`` and ``10.5``)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer field (the documented schema says "integer", which 10.0 is).
Int = Annotated[int, BeforeValidator(_integral)]
# A token id: a 400 naming its place for a negative one, as the documented schema says.
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX), BeforeValidator(_integral)]


class StreamOptions(_Strict):
    """stream_options: include_usage; include_obfuscation is accepted (no padding is sent)."""

    include_usage: bool = False
    include_obfuscation: bool | None = None


class _SamplingFields(StructuredFields):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    model: str | None = None
    n: Int = _range(1, MAX_N, 1)
    temperature: float = _doc(default=1.0, minimum=0)
    top_p: float = _doc(default=1.0, exclusiveMinimum=0, maximum=1)
    seed: Int | None = _range(INT64_MIN, INT64_MAX, None)
    stop: str | list[str] | None = _doc(maxItems=MAX_STOP, minLength=1, items={"minLength": 1})
    presence_penalty: float = _range(-2, 2, 0.0)
    frequency_penalty: float = _range(-2, 2, 0.0)
    logit_bias: dict[str, float] | None = _doc(
        maxProperties=MAX_LOGIT_BIAS,
        propertyNames={"pattern": "^[0-9]{1,10}$"},
        additionalProperties={"type": "number", "minimum": -100, "maximum": 100},
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own bookkeeping; not used
    # Accepted and ignored (IGNORED_FIELDS): storage, tags and routing hints of OpenAI's.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # one engine-wide prefix cache serves every key
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # vLLM's extra sampling parameters.
    top_k: Int = _range(-1, INT32_MAX, 0)
    min_p: float = _range(0, 1, 0.0)
    repetition_penalty: float = _doc(default=1.0, exclusiveMinimum=0)
    stop_token_ids: list[Int] | None = _doc(maxItems=MAX_STOP_TOKEN_IDS, items=_TOKEN_ID)
    ignore_eos: bool = False
    min_tokens: Int = _range(0, INT32_MAX, 0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def log_ignored(self, more: tuple[str, ...] = ()) -> None:
        """One debug line naming the fields given that change nothing here."""
        given = [f for f in (*IGNORED_FIELDS, "user", *more) if getattr(self, f) is not None]
        if given:
            logger.debug("request fields accepted and ignored: %s", ", ".join(given))

    def check_stream_options(self) -> None:
        """OpenAI refuses stream_options without stream; so do we."""
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def _params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        rename: dict[str, str] | None = None,
        defaults: dict[str, float | int] | None = None,
    ) -> SamplingParams:
        """SamplingParams; a bad value is a 400 naming the request field.

        ``rename`` maps a SamplingParams field to the request field that set it.
        ``defaults``: the model's sampling defaults (its generation_config), used for the
        fields this request leaves out, as vLLM's ``--generation-config auto``.
        """
        structured_outputs, _ = self.constraint()
        sampling = {
            name: getattr(self, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        }
        sampling |= model_defaults(defaults, self.model_fields_set, sampling)
        try:
            return SamplingParams(
                n=self.n,
                seed=self.seed,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                **sampling,
                logit_bias=self.logit_bias,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                structured_outputs=structured_outputs,
            )
        except ParameterError as e:
            raise request_error(e, rename or {}) from None


def model_defaults(
    defaults: dict[str, float | int] | None, given: set[str], fields: Iterable[str]
) -> dict[str, float | int]:
    """The model's sampling defaults for those of ``fields`` a request did not set."""
    return {k: v for k, v in (defaults or {}).items() if k in fields and k not in given}


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[Int] | list[str] | list[list[Int]] = Field(
        json_schema_extra={"minLength": 1, "minItems": 1, "maxItems": MAX_SEQUENCES}
    )
    max_tokens: Int | None = _range(1, INT32_MAX, 16)
    logprobs: Int | None = _range(0, MAX_LOGPROBS, None)
    echo: bool = False
    # Only best_of equal to n is served (no server-side best-of selection): a 400 otherwise.
    best_of: Int | None = _range(1, MAX_N, None)
    add_special_tokens: bool = True

    def sampling_params(self, defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """The request's SamplingParams; ``defaults``: the model's (see _params)."""
        self.check_stream_options()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(
                f"best_of={self.best_of} is not supported: only best_of equal to n ({self.n})",
                "best_of",
            )
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        max_tokens = self.max_tokens
        if "max_tokens" not in self.model_fields_set and defaults and "max_tokens" in defaults:
            max_tokens = int(defaults["max_tokens"])
        return self._params(
            max_tokens, self.logprobs, prompt_logprobs, self.field_names(), defaults
        )

    def field_names(self) -> dict[str, str]:
        """SamplingParams / engine parameter -> the field of this request that set it."""
        return {"prompt_logprobs": "logprobs"} | self.constraint()[1]

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (texts or token id lists)."""
        p = self.prompt
        if isinstance(p, str):
            items: list[str | list[int]] = [p]
        elif p and all(isinstance(t, int) for t in p):
            items = [list(p)]  # type: ignore[arg-type]
        else:
            items = list(p)  # type: ignore[arg-type]
        if not items:
            raise bad_request("prompt must not be empty", "prompt")
        if len(items) * self.n > MAX_SEQUENCES:
            raise bad_request(
                f"prompt has {len(items)} prompts and n is {self.n}: a request may ask for at "
                f"most {MAX_SEQUENCES} sequences (prompts x n)",
                "prompt",
            )
        return items


def _document_message(schema: dict[str, Any]) -> None:
    # The documented shape: text parts, and the keys chat templates read. Other keys are
    # still accepted and handed to the template as they are.
    text_part = {
        "type": "object",
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"],
        "additionalProperties": False,
    }
    props = schema["properties"]
    # null content is accepted, but most chat templates need text: document text.
    props["content"] = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}
    schema["required"] = ["role", "content"]
    props["name"] = {"type": "string"}
    props["tool_call_id"] = {"type": "string"}
    props["tool_calls"] = {"type": "array", "items": {"type": "object"}}
    schema["additionalProperties"] = False
    schema["description"] = "A chat message; other keys are passed to the chat template as is."


class ChatMessage(BaseModel):
    """One message; keys beyond role/content (name, tool_calls, ...) go to the template."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_document_message)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else ():
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported (only 'text')")
            if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                raise ValueError("a text part is {'type': 'text', 'text': <string>}")
        return content

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template sees it.

        Text parts stay a list: the template joins them by newlines unless it iterates
        over content parts itself (see mlxserve.tokenizer.chat_template).
        """
        msg = self.model_dump(exclude_none=True)
        if msg["role"] == "developer":  # OpenAI's newer name for the system role
            msg["role"] = "system"
        return msg


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = _range(1, INT32_MAX, None)
    max_completion_tokens: Int | None = _range(1, INT32_MAX, None)
    logprobs: bool = False
    top_logprobs: Int | None = _range(0, MAX_LOGPROBS, None)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    # Whether the model may call several tools in one reply (default true).
    parallel_tool_calls: bool | None = None
    # The model's reasoning switch (reasoning_effort.py); chat_template_kwargs override it.
    reasoning_effort: str | None = None
    # Accepted: a hint (verbosity), a latency hint whose output is the same (prediction), text
    # as the only modality, and OpenAI's hosted web search, which has nothing to run it here.
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: dict[str, Any] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    web_search_options: dict[str, Any] | None = None
    # Refused when set (check_refused): audio output, moderation, the legacy functions.
    audio: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM's chat extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_refused(self) -> None:
        """400 for fields whose request mlxserve cannot honour and must not pretend to."""
        if self.audio is not None or "audio" in (self.modalities or ()):
            param = "audio" if self.audio is not None else "modalities"
            raise bad_request(
                "audio output is not supported by this server: its model writes text only",
                param,
            )
        if self.moderation is not None:
            raise bad_request(
                "moderation is not supported by this server: leave moderation out", "moderation"
            )
        if self.functions or self.function_call is not None:  # "functions": [] is none
            raise bad_request(
                "functions and function_call are deprecated and not supported by this server: "
                "use tools and tool_choice",
                "functions" if self.functions else "function_call",
            )
        if self.web_search_options is not None:
            logger.warning("chat: web_search_options ignored: this server runs no web search")

    def template_kwargs(self) -> dict[str, Any]:
        """Variables for the chat template: the reasoning switch, then chat_template_kwargs."""
        switch = effort_template_kwargs(self.reasoning_effort, "reasoning_effort")
        return switch | dict(self.chat_template_kwargs or {})

    def sampling_params(self, defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """The request's SamplingParams; ``defaults``: the model's (see _params)."""
        self.check_stream_options()
        self.check_refused()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_tokens
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            max_tokens = self.max_completion_tokens
        if max_tokens is None and defaults and "max_tokens" in defaults:
            max_tokens = int(defaults["max_tokens"])
        return self._params(max_tokens, logprobs, rename=self.field_names(), defaults=defaults)

    def field_names(self) -> dict[str, str]:
        """SamplingParams / engine parameter -> the field of this request that set it."""
        names = {"logprobs": "top_logprobs"} | self.constraint()[1]
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        if isinstance(self.tool_choice, BaseModel) or self.tool_choice == "required":
            names |= {"structured_outputs": "tool_choice", "structured_outputs.grammar": "tools"}
        return names

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template sees them."""
        return [m.to_template() for m in self.messages]

    def tool_choice_name(self) -> str | None:
        """tool_choice as "none" / "auto" / "required" / a function's name (None: unset)."""
        choice = self.tool_choice
        return choice if isinstance(choice, str) or choice is None else choice.function.name


class TokenizeRequest(_Strict):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # rendered as /v1/chat/completions renders them
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


def request_error(e: ParameterError, rename: dict[str, str]) -> APIError:
    """A SamplingParams or engine ParameterError as a 400 naming the request's own field."""
    param = e.parameter
    message = str(e)
    if param in rename:
        if message.startswith(param):  # the message names the field first: name it as sent
            message = rename[param] + message[len(param) :]
        param = rename[param]
    return bad_request(message, param)
