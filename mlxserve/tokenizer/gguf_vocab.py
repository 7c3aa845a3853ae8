"""Build a Hugging Face `tokenizers` backend from GGUF tokenizer metadata, as llama.cpp reads it.

Two vocab types are supported:
- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE (tokens + merges); the pre-tokenizer split is
  chosen by ``tokenizer.ggml.pre`` (same regexes as llama.cpp; an unknown value is refused, as
  llama.cpp refuses it, because a wrong split silently degrades the model).
- ``"llama"``: SentencePiece BPE (tokens + scores); merges are rebuilt from the scores, spaces
  become "▁", a "▁" is prepended to each text segment when ``add_space_prefix``, unknown
  characters fall back to ``<0xXX>`` byte tokens.
CONTROL / UNKNOWN tokens are special (parsed out of text, skipped by ``skip_special_tokens``);
USER_DEFINED tokens are parsed out of text but decoded as text, as llama.cpp does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE_MARK = "\u2581"  # "▁", SentencePiece's visible space

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# The (?i:...) contractions of the original tokenizer.json, ASCII-only as llama.cpp spells them.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _CONTRACTIONS
    + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CONTRACTIONS
    + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How llama.cpp splits text before BPE for one family of ``tokenizer.ggml.pre`` values."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a whole pre-token found in the vocab is taken as is
    add_bos: bool = False  # default for tokenizer.ggml.add_bos_token when the key is missing


_DEFAULT = PreTokenizerSpec(
    (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
)
_FAMILIES: list[tuple[tuple[str, ...], PreTokenizerSpec]] = [
    (("default",), _DEFAULT),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2"),
        PreTokenizerSpec((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    (("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), PreTokenizerSpec((_LLAMA3,))),
    (("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), PreTokenizerSpec((_QWEN2,))),
    (
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        PreTokenizerSpec((r"\p{N}", _GPT2)),
    ),
    (
        ("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "gigachat", "trillion", "roberta-bpe"),
        PreTokenizerSpec((_GPT2,)),
    ),
    (
        ("falcon",),
        PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    ),
    (("tekken",), PreTokenizerSpec((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4"), PreTokenizerSpec((_GPT4O,))),
    (
        ("deepseek-v3",),
        PreTokenizerSpec(
            (
                r"\p{N}{1,3}",
                r"[一-龥぀-ゟ゠-ヿ]+",
                r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?"
                r"[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            )
        ),
    ),
]
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    name: spec for names, spec in _FAMILIES for name in names
}

# Token texts llama.cpp treats as end-of-generation even when no metadata key names them.
_EOG_TEXTS = frozenset(
    [
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek
    ]
)


@dataclass(frozen=True)
class GGUFVocab:
    """A tokenizers backend plus the special-token facts read from GGUF metadata."""

    backend: Backend
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: frozenset[int]  # eos, eot, eom and the end-of-generation tokens found by text
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | dict[str, str] | None


def _plain(value: Any) -> Any:
    """mx.array / numpy scalars and arrays -> Python values; everything else unchanged."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _get(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    return _plain(meta[key]) if key in meta else default


def _array(meta: Mapping[str, Any], key: str, n: int, source: str) -> list[Any] | None:
    value = _get(meta, key)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) < n:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise ValueError(f"{source}: {key} must be a list of at least {n} entries, got {got}")
    return value[:n]


def _token_id(meta: Mapping[str, Any], key: str, default: int | None, n: int) -> int | None:
    value = _get(meta, key)
    if value is None:
        return default if default is not None and 0 <= default < n else None
    value = int(value)
    if not 0 <= value < n:
        logger.warning("%s = %d is outside the vocab (size %d); ignoring it", key, value, n)
        return default if default is not None and 0 <= default < n else None
    return value


def chat_templates(meta: Mapping[str, Any]) -> str | dict[str, str] | None:
    """tokenizer.chat_template, with the named ones (tokenizer.chat_template.NAME) as a dict."""
    default = _get(meta, "tokenizer.chat_template")
    named = {
        key.removeprefix("tokenizer.chat_template."): _get(meta, key)
        for key in meta
        if key.startswith("tokenizer.chat_template.")
    }
    if not named:
        return default
    if default is not None:
        named["default"] = default
    return named


def build_gguf_vocab(meta: Mapping[str, Any], source: str = "GGUF metadata") -> GGUFVocab:
    """The tokenizer described by GGUF metadata (``mx.load(..., return_metadata=True)[1]``)."""
    model = _get(meta, "tokenizer.ggml.model")
    if model is None:
        raise ValueError(f"{source}: no tokenizer metadata (tokenizer.ggml.model is missing)")
    if model not in ("gpt2", "llama"):
        raise ValueError(
            f"{source}: tokenizer.ggml.model={model!r} is not supported "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
        )
    tokens = _get(meta, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{source}: tokenizer.ggml.tokens is missing or empty")
    n = len(tokens)
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    types = _array(meta, "tokenizer.ggml.token_type", n, source) or [NORMAL] * n
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if tok in vocab:
            raise ValueError(
                f"{source}: tokenizer.ggml.tokens has duplicate token {tok!r} "
                f"at ids {vocab[tok]} and {i}"
            )
        vocab[tok] = i

    is_spm = model == "llama"
    bos_id = _token_id(meta, "tokenizer.ggml.bos_token_id", 1 if is_spm else None, n)
    eos_id = _token_id(meta, "tokenizer.ggml.eos_token_id", 2 if is_spm else None, n)
    unk_id = _token_id(meta, "tokenizer.ggml.unknown_token_id", 0 if is_spm else None, n)
    pad_id = _token_id(meta, "tokenizer.ggml.padding_token_id", None, n)
    eot_id = _token_id(meta, "tokenizer.ggml.eot_token_id", None, n)
    eom_id = _token_id(meta, "tokenizer.ggml.eom_token_id", None, n)

    if is_spm:
        backend, add_bos_default = _build_spm(meta, tokens, types, vocab, unk_id, source), True
    else:
        backend, add_bos_default = _build_bpe(meta, tokens, vocab, source)
    add_bos = (
        bool(_get(meta, "tokenizer.ggml.add_bos_token", add_bos_default)) and bos_id is not None
    )
    add_eos = bool(_get(meta, "tokenizer.ggml.add_eos_token", False)) and eos_id is not None

    # Special tokens are matched in raw text before normalization, longest first (llama.cpp order).
    added = [
        AddedToken(tokens[i], special=types[i] != USER_DEFINED, normalized=False)
        for i in sorted(range(n), key=lambda i: -len(tokens[i]))
        if types[i] in (CONTROL, UNKNOWN, USER_DEFINED)
    ]
    backend.add_tokens(added)
    eog = {i for i in (eos_id, eot_id, eom_id) if i is not None}
    found = {vocab[t] for t in _EOG_TEXTS if t in vocab}
    if {"<|return|>", "<|call|>", "<|end|>"} <= vocab.keys():
        found.discard(vocab["<|end|>"])  # gpt-oss: <|end|> closes a message, not the generation
    return GGUFVocab(
        backend=backend,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        eos_token_ids=frozenset(eog | found),
        pad_token_id=pad_id,
        unk_token_id=unk_id,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=chat_templates(meta),
    )


def _build_bpe(
    meta: Mapping[str, Any], tokens: list[str], vocab: dict[str, int], source: str
) -> tuple[Backend, bool]:
    raw_merges = _get(meta, "tokenizer.ggml.merges")
    if not isinstance(raw_merges, list):
        raise ValueError(f"{source}: tokenizer.ggml.merges is missing (required for 'gpt2' vocab)")
    merges = []
    for rank, merge in enumerate(raw_merges):
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ValueError(
                f"{source}: tokenizer.ggml.merges[{rank}]={merge!r} is not 'left right'"
            )
        merges.append((merge[:cut], merge[cut + 1 :]))
    pre = _get(meta, "tokenizer.ggml.pre")
    if pre is None:
        logger.warning(
            "%s: tokenizer.ggml.pre is missing; using llama.cpp's 'default' split", source
        )
        spec = _DEFAULT
    elif pre in PRE_TOKENIZERS:
        spec = PRE_TOKENIZERS[pre]
    else:
        raise ValueError(
            f"{source}: tokenizer.ggml.pre={pre!r} is not supported "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    try:
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges)
    except Exception as e:  # tokenizers raises its own exception type for bad merges
        raise ValueError(f"{source}: tokenizer.ggml.merges do not fit the vocab: {e}") from e
    backend = Backend(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    backend.decoder = decoders.ByteLevel()
    return backend, spec.add_bos


def _build_spm(
    meta: Mapping[str, Any],
    tokens: list[str],
    types: list[int],
    vocab: dict[str, int],
    unk_id: int | None,
    source: str,
) -> Backend:
    n = len(tokens)
    scores = _array(meta, "tokenizer.ggml.scores", n, source)
    if scores is None:
        raise ValueError(f"{source}: tokenizer.ggml.scores is missing (required for 'llama' vocab)")
    merges = _merges_from_scores(tokens, scores, types, vocab)
    has_bytes = any(t == BYTE for t in types)
    model = models.BPE(
        vocab=vocab,
        merges=merges,
        unk_token=tokens[unk_id] if unk_id is not None else None,
        byte_fallback=has_bytes,
        fuse_unk=True,
    )
    backend = Backend(model)
    add_space_prefix = bool(_get(meta, "tokenizer.ggml.add_space_prefix", True))
    # llama.cpp prepends a space to every text segment that starts the text or follows a special
    # token; tokenizers normalizes each segment between added tokens separately, so this matches.
    steps = [normalizers.Prepend(SPACE_MARK)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE_MARK)])
    chain = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        chain.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(chain)
    return backend


def _merges_from_scores(
    tokens: list[str], scores: list[float], types: list[int], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """SentencePiece BPE merges: each split of a normal piece into two vocab pieces, best first.

    llama.cpp (like SentencePiece) repeatedly joins the adjacent pair whose joined text is the
    highest-scoring vocab piece; ranking merges by the joined piece's score reproduces that.
    """
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, piece in enumerate(tokens):
        if types[i] != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), i, vocab[left], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]
