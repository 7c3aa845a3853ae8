"""Ollama's request bodies (/api/*) and how their options map to SamplingParams.

Options map to SamplingParams; runtime options (num_ctx, num_gpu, ...) set the server, not a
request, and are accepted with no effect; a sampling option mlxserve does not implement is a
400 naming it, unless it holds Ollama's neutral value.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict

from mlxserve.exceptions import ParameterError
from mlxserve.sampling_params import SamplingParams, StructuredOutputsParams
from mlxserve.server.errors import bad_request
from mlxserve.server.protocol import _Strict

# Ollama option -> SamplingParams field.
OPTION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# Runtime options: they size or place the model, which the server's flags decide.
RUNTIME_OPTIONS = {
    "num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "low_vram",
    "use_mmap", "use_mlock", "numa", "vocab_only", "f16_kv", "logits_all",
}  # fmt: skip
# Sampling options not implemented, with the value that leaves sampling unchanged.
NEUTRAL_OPTIONS = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0, "penalize_newline": False}


class OllamaMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # earlier reasoning: not part of the next prompt
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    images: list[str] | None = None


class _Common(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    stream: bool = True
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None  # 0: see ollama_models.py
    format: str | dict[str, Any] | None = None
    think: bool | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """``format``: "json" (any JSON object) or a JSON schema, enforced by a grammar."""
        if self.format in (None, ""):
            return None
        if self.format == "json":
            return StructuredOutputsParams(json_object=True)
        if isinstance(self.format, dict):
            return StructuredOutputsParams(json=self.format)
        raise bad_request(f"format must be 'json' or a JSON schema, got {self.format!r}", "format")

    def sampling_params(self, defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """The options as SamplingParams; a bad or unimplemented one is a 400 naming it.
        ``defaults``: the model's (as a Modelfile's parameters), under the options."""
        values: dict[str, Any] = {"max_tokens": None} | dict(defaults or {})
        for key, value in (self.options or {}).items():
            if key in OPTION_FIELDS:
                values[OPTION_FIELDS[key]] = value
            elif key == "num_predict":
                if not isinstance(value, int) or isinstance(value, bool):
                    raise bad_request("num_predict must be an integer", "options.num_predict")
                values["max_tokens"] = value if value > 0 else None  # -1, -2: no limit
            elif key in RUNTIME_OPTIONS:
                continue
            elif key in NEUTRAL_OPTIONS and value == NEUTRAL_OPTIONS[key]:
                continue
            else:
                raise bad_request(f"option {key!r} is not supported by mlxserve", f"options.{key}")
        try:
            params = SamplingParams(**values)
            params.structured_outputs = self.constraint()
            return params
        except (ParameterError, TypeError) as e:
            name = getattr(e, "parameter", None)
            option = next((k for k, v in OPTION_FIELDS.items() if v == name), name)
            raise bad_request(str(e), f"options.{option}" if option else "options") from None


class OllamaChatRequest(_Common):
    messages: list[OllamaMessage]
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(_Common):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None


class OllamaEmbedRequest(_Strict):
    model: str
    input: str | list[str]
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    dimensions: int | None = None


class OllamaEmbeddingsRequest(_Strict):
    model: str
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class _Named(_Strict):
    model: str | None = None
    name: str | None = None  # Ollama's older name of ``model``


class OllamaShowRequest(_Named):
    """POST /api/show (documented; read by hand)."""

    verbose: bool | None = None


class OllamaPullRequest(_Named):
    """POST /api/pull (documented; read by hand)."""

    insecure: bool | None = None
    stream: bool | None = None


class OllamaDeleteRequest(_Named):
    """DELETE /api/delete (documented; read by hand)."""


class OllamaCopyRequest(_Strict):
    """POST /api/copy (documented; read by hand): serve ``source`` as ``destination`` too."""

    source: str
    destination: str
