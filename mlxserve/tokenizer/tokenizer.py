"""Tokenizer: encode/decode, special tokens and chat templates for HF directories and GGUF files."""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from mlxserve.exceptions import ParameterError
from mlxserve.gguf_file import read_gguf_metadata
from mlxserve.tokenizer.chat_template import ChatTemplate, make_environment
from mlxserve.tokenizer.gguf_vocab import build_gguf_vocab
from mlxserve.tokenizer.harmony import (
    HARMONY_TEXT_TOKENS,
    HARMONY_TOKENS,
    MODEL_IDENTITY,
    render_harmony,
)
from mlxserve.tokenizer.hf_dir import read_hf_dir
from mlxserve.tokenizer.system_notes import as_user_notes, later_system_indices

REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_tokens(run: bytes) -> list[str]:
    """<0xXX> tokens for the UTF-8 of the lossy decoding of `run` (always a valid run)."""
    fixed = run.decode("utf-8", errors="replace").encode("utf-8")
    return [f"<0x{b:02X}>" for b in fixed]


def _added_around(backend: Backend) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after a text's own ids."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []


class Tokenizer:
    """Text <-> token ids for one model, plus its special tokens and chat template."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        chat_template: str | dict[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        name: str = "tokenizer",
    ) -> None:
        self.backend = backend
        self.name = name
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        eos = set(extra_eos_token_ids)
        if eos_token_id is not None:
            eos.add(eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.chat_templates = chat_template
        # "harmony": gpt-oss's vocabulary; chats go through the harmony renderer (checked
        # against openai-harmony), not the Jinja template. Set to "jinja" to use the template.
        harmony = all(backend.token_to_id(t) is not None for t in HARMONY_TOKENS)
        self.chat_format = "harmony" if harmony else "jinja"
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        for key, token_id in (("bos_token", bos_token_id), ("eos_token", eos_token_id)):
            if token_id is not None and key not in self.special_tokens:
                self.special_tokens[key] = self.id_to_token(token_id) or ""
        added = backend.get_added_tokens_decoder()
        # The ids decode(skip_special_tokens=True) drops: the backend's special tokens, but a
        # harmony reply keeps its headers (llama.cpp's gpt-oss rule; a GGUF vocab applies it).
        special = {i for i, tok in added.items() if tok.special}
        if harmony:
            special -= {backend.token_to_id(t) for t in HARMONY_TEXT_TOKENS}
        self.all_special_ids: frozenset[int] = frozenset(special)
        # Explicit flags (GGUF metadata, tokenizer_config.json) decide BOS/EOS; otherwise the
        # backend's post-processor does, and the flags describe what it does.
        self._manual_bos_eos = add_bos_token is not None or add_eos_token is not None
        before, after = _added_around(backend)
        if add_bos_token is None:
            add_bos_token = bos_token_id is not None and before == [bos_token_id]
        if add_eos_token is None:
            add_eos_token = eos_token_id is not None and after == [eos_token_id]
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.add_eos_token = add_eos_token and eos_token_id is not None
        self._byte_fallback = "ByteFallback" in repr(backend.decoder)
        self._env = make_environment()
        self._compiled: dict[str, ChatTemplate] = {}

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face model directory (tokenizer.json required)."""
        files = read_hf_dir(path)
        return cls(
            files.backend,
            bos_token_id=files.bos_token_id,
            eos_token_id=files.eos_token_id,
            extra_eos_token_ids=files.eos_token_ids,
            pad_token_id=files.pad_token_id,
            add_bos_token=files.add_bos_token,
            add_eos_token=files.add_eos_token,
            chat_template=files.chat_template,
            special_tokens=files.special_tokens,
            name=str(path),
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer embedded in a GGUF file (reads only the metadata header)."""
        return cls.from_gguf_metadata(read_gguf_metadata(path), source=str(path))

    @classmethod
    def from_gguf_metadata(
        cls, meta: Mapping[str, Any], source: str = "GGUF metadata"
    ) -> Tokenizer:
        """Build from GGUF metadata, e.g. ``mx.load(path, return_metadata=True)[1]``."""
        vocab = build_gguf_vocab(meta, source)
        tok = cls(
            vocab.backend,
            bos_token_id=vocab.bos_token_id,
            eos_token_id=vocab.eos_token_id,
            extra_eos_token_ids=vocab.eos_token_ids,
            pad_token_id=vocab.pad_token_id,
            add_bos_token=vocab.add_bos_token,
            add_eos_token=vocab.add_eos_token,
            chat_template=vocab.chat_template,
            name=source,
        )
        if vocab.unk_token_id is not None:
            tok.special_tokens["unk_token"] = tok.id_to_token(vocab.unk_token_id) or ""
        if vocab.pad_token_id is not None:
            tok.special_tokens["pad_token"] = tok.id_to_token(vocab.pad_token_id) or ""
        return tok

    # ---- tokens -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        """Text of the BOS token, if the model has one."""
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """Text of the EOS token, if the model has one."""
        return self.special_tokens.get("eos_token")

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocab entry (its stored form, e.g. 'Ġthe' or '▁the'), None when absent."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Stored form of a token id, None when out of range."""
        return self.backend.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        """True for special (control) tokens: those decode(skip_special_tokens=True) drops."""
        return token_id in self.all_special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text is parsed; BOS/EOS added as the model says."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        if not self._manual_bos_eos:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos_token:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids` (ids outside the vocab decode to nothing).

        Invalid UTF-8 decodes to U+FFFD per maximal invalid subsequence, so the text of a prefix
        of ids is a prefix of the text of all ids (once its last character is complete).
        """
        ids = list(token_ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.all_special_ids]
        text = self.backend.decode(ids, skip_special_tokens=False)
        if self._byte_fallback and REPLACEMENT_CHAR in text:
            return self._decode_byte_runs(ids, skip_special_tokens)
        return text

    def _decode_byte_runs(self, ids: list[int], skip_special_tokens: bool) -> str:
        # tokenizers' ByteFallback turns a whole run of <0xXX> tokens into one U+FFFD per byte
        # when any byte in it is invalid, so a later byte could change text already streamed.
        # Re-encode each run's bytes as their lossy decoding before running the decoder chain.
        tokens: list[str] = []
        run = bytearray()
        for token_id in ids:
            if skip_special_tokens and token_id in self.all_special_ids:
                continue
            token = self.backend.id_to_token(token_id)
            if token is None:
                continue
            if _BYTE_TOKEN.fullmatch(token):
                run.append(int(token[3:5], 16))
                continue
            if run:
                tokens += _byte_tokens(run)
                run.clear()
            tokens.append(token)
        if run:
            tokens += _byte_tokens(run)
        return self.backend.decoder.decode(tokens)

    # ---- chat ---------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template source, None when the model has none."""
        templates = self.chat_templates
        if isinstance(templates, dict):
            return templates.get("default")
        return templates

    def get_chat_template(
        self, chat_template: str | None = None, tools: Sequence[Any] | None = None
    ) -> str:
        """Pick a template source as transformers does (named templates, 'tool_use' with tools)."""
        templates = self.chat_templates
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(
                f"{self.name}: the model has several chat templates {sorted(templates)} and none "
                "is 'default'; pass chat_template=<name>"
            )
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError(
                f"{self.name}: the model has no chat template; pass chat_template=... "
                "(a Jinja template string) or use plain text completion"
            )
        return templates

    def compiled_chat_template(
        self, chat_template: str | None = None, tools: Sequence[Any] | None = None
    ) -> ChatTemplate:
        """The template get_chat_template picks, compiled (once)."""
        source = self.get_chat_template(chat_template, tools)
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = self._compiled[source] = ChatTemplate(source, self._env)
        return compiled

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """Render `messages` (OpenAI-style dicts) to the prompt text with the model's template.

        A harmony tokenizer (gpt-oss) renders with the harmony renderer unless a template is
        passed; ``reasoning_effort``, ``current_date`` and ``model_identity`` are its options.
        """
        if self.chat_format == "harmony" and chat_template is None:
            if continue_final_message:
                raise ParameterError(
                    "continue_final_message is not supported by the harmony chat format",
                    "continue_final_message",
                )
            # Harmony has one developer message at the top: later system messages are notes.
            return render_harmony(
                as_user_notes(messages) if later_system_indices(messages) else messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                reasoning_effort=extra.get("reasoning_effort") or "medium",
                current_date=extra.get("current_date") or datetime.date.today().isoformat(),
                model_identity=extra.get("model_identity") or MODEL_IDENTITY,
            )
        compiled = self.compiled_chat_template(chat_template, tools)
        return compiled.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            continue_final_message=continue_final_message,
            variables={**self.special_tokens, **extra},
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **extra: Any,
    ) -> list[int]:
        """Token ids of the rendered chat; BOS added only if the model wants it and it is absent."""
        text = self.apply_chat_template(
            messages, add_generation_prompt, tools, chat_template, **extra
        )
        return self.encode_rendered_chat(text)

    def encode_rendered_chat(self, text: str) -> list[int]:
        """Token ids of a rendered chat template (special tokens parsed, no double BOS)."""
        ids = self.encode(text, add_special_tokens=False)
        bos = self.bos_token_id
        if self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={sorted(self.eos_token_ids)}, add_bos={self.add_bos_token})"
        )
