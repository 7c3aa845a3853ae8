"""A model's own sampling defaults: generation_config.json, or a GGUF's general.sampling.*.

As vLLM does (``--generation-config auto``), only these keys are taken, renamed to
SamplingParams' fields; a front-end decides what they are defaults for (``mlxserve run``
uses them under explicit flags, ``serve`` for fields a request leaves out, ``LLM`` when no
SamplingParams is given). The embedded default model carries neither file: its model
card's values come with its resolution (``loader.DEFAULT_MODEL_SAMPLING``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger("mlxserve")

# generation_config.json key -> SamplingParams field (vLLM's list)
HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# GGUF metadata key -> SamplingParams field (llama.cpp's convert_hf_to_gguf.py writes these
# from generation_config.json). penalty_last_n has no equivalent here (penalties see all).
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
INT_FIELDS = ("top_k", "max_tokens")


def from_model_dir(model_dir: Path) -> dict[str, float | int]:
    """The sampling defaults of a model directory's generation_config.json ({} if none)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        logger.warning("%s: unreadable (%s): no sampling defaults taken from it", path, e)
        return {}
    if not isinstance(config, dict):
        return {}
    return _checked({HF_KEYS[k]: v for k, v in config.items() if k in HF_KEYS}, str(path))


def from_gguf_metadata(metadata: dict, source: str = "GGUF") -> dict[str, float | int]:
    """The sampling defaults a GGUF file carries in general.sampling.* ({} if none)."""
    values = {f: metadata[k] for k, f in GGUF_KEYS.items() if k in metadata}
    # Stored as float32: 0.7 reads back as 0.699999988; 7 digits is all float32 holds.
    values = {k: float(f"{v:.7g}") if isinstance(v, float) else v for k, v in values.items()}
    return _checked(values, source)


def _checked(values: dict[str, object], source: str) -> dict[str, float | int]:
    """Numbers SamplingParams accepts, one by one; others are dropped with a warning."""
    from mlxserve.sampling_params import SamplingParams

    out: dict[str, float | int] = {}
    for name, value in values.items():
        if name in INT_FIELDS and isinstance(value, float) and value.is_integer():
            value = int(value)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            logger.warning("%s: ignoring %s=%r (not a number)", source, name, value)
            continue
        try:
            SamplingParams(**{name: value})
        except ValueError as e:
            logger.warning("%s: ignoring %s (%s)", source, name, e)
            continue
        out[name] = value
    return out
