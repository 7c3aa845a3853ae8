"""Read a Hugging Face model directory's tokenizer files the way transformers does."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

# Named special tokens a chat template can see (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores a special token as a string or as {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _ids(value: Any) -> list[int]:
    """An eos_token_id field: int, list of ints or missing."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def chat_template_from_dir(path: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja (+ additional_chat_templates/), else tokenizer_config, else .json."""
    templates: dict[str, str] = {}
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if not templates:
        value = config.get("chat_template")
        if value is None:
            value = _read_json(path / "chat_template.json").get("chat_template")
        if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
            templates = {t["name"]: t["template"] for t in value if "name" in t and "template" in t}
        elif isinstance(value, str):
            return value
    if list(templates) == ["default"]:
        return templates["default"]
    return templates or None


@dataclass(frozen=True)
class HFTokenizerFiles:
    """A tokenizers backend plus the special-token facts of an HF model directory."""

    backend: Backend
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as the chat template sees them
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # generation_config.json and config.json (text_config too)
    pad_token_id: int | None
    add_bos_token: bool | None  # explicit flags of tokenizer_config.json, None when absent
    add_eos_token: bool | None
    chat_template: str | dict[str, str] | None


def read_hf_dir(path: str | Path) -> HFTokenizerFiles:
    """tokenizer.json (required), tokenizer_config.json, special_tokens_map.json,
    generation_config.json, config.json and chat template files of a model directory."""
    path = Path(path)
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(
            f"{tokenizer_file}: not found; mlxserve needs a Hugging Face tokenizer.json "
            "(directories with only a SentencePiece tokenizer.model are not supported)"
        )
    try:
        backend = Backend.from_file(str(tokenizer_file))
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise ValueError(f"{tokenizer_file}: not a valid tokenizers file: {e}") from e
    config = _read_json(path / "tokenizer_config.json")
    legacy_map = _read_json(path / "special_tokens_map.json")
    generation = _read_json(path / "generation_config.json")
    model_config = _read_json(path / "config.json")

    special: dict[str, str] = {}
    for key in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(key)) or _token_text(legacy_map.get(key))
        if text is not None:
            special[key] = text
    _add_missing_tokens(backend, config.get("added_tokens_decoder") or {}, special)

    def token_id(key: str) -> int | None:
        return backend.token_to_id(special[key]) if key in special else None

    config_eos = _ids(generation.get("eos_token_id")) + _ids(model_config.get("eos_token_id"))
    text_config = model_config.get("text_config")
    if isinstance(text_config, Mapping):
        config_eos += _ids(text_config.get("eos_token_id"))
    eos_id = token_id("eos_token")
    if eos_id is None and config_eos:
        eos_id = config_eos[0]
    pad_id = token_id("pad_token")
    if pad_id is None:
        pads = _ids(generation.get("pad_token_id")) or _ids(model_config.get("pad_token_id"))
        pad_id = pads[0] if pads else None
    return HFTokenizerFiles(
        backend=backend,
        special_tokens=special,
        bos_token_id=token_id("bos_token"),
        eos_token_id=eos_id,
        eos_token_ids=tuple(config_eos),
        pad_token_id=pad_id,
        # llama.cpp's converter copies these flags into GGUF; honoring them keeps a model's HF
        # directory and its GGUF agreeing (transformers 4.x did the same for Llama-like models)
        add_bos_token=_flag(config.get("add_bos_token")),
        add_eos_token=_flag(config.get("add_eos_token")),
        chat_template=chat_template_from_dir(path, config),
    )


def _add_missing_tokens(
    backend: Backend, declared: Mapping[str, Any], special: Mapping[str, str]
) -> None:
    """Tokens the config declares but tokenizer.json lacks are added, as transformers does."""
    missing = [
        AddedToken(
            t["content"],
            special=bool(t.get("special", True)),
            normalized=bool(t.get("normalized", False)),
            lstrip=bool(t.get("lstrip", False)),
            rstrip=bool(t.get("rstrip", False)),
            single_word=bool(t.get("single_word", False)),
        )
        for _, t in sorted(declared.items(), key=lambda kv: int(kv[0]))
        if isinstance(t, Mapping) and t.get("content") and backend.token_to_id(t["content"]) is None
    ]
    names = {str(t) for t in missing}
    missing += [
        AddedToken(text, special=True, normalized=False)
        for text in special.values()
        if backend.token_to_id(text) is None and text not in names
    ]
    if missing:
        backend.add_tokens(missing)
