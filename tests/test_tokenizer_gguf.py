"""GGUF tokenizers against independent oracles: llama.cpp's fixture, MLX's GGUF reader,
SentencePiece itself, and transformers' Qwen2 / GPT-2 tokenizers on the same vocab."""

from __future__ import annotations

import io
import json
import unicodedata
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import pytest
import sentencepiece as spm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from mlxserve.gguf_file import read_gguf_metadata
from mlxserve.tokenizer import Tokenizer
from tests.gguf_helpers import close_gguf
from tests.paths import SMOLLM2_GGUF, llamacpp_oracle

SMOLLM2 = SMOLLM2_GGUF
FIXTURE = llamacpp_oracle()

TEXTS = [
    "Hello world!",
    "  Leading spaces and trailing  ",
    "I'm sure they'll say DON'T; we've seen 'quotes' it's",
    "Numbers 1234567890, 3.14159 and 42nd",
    "tabs\tand\nnewlines\n\n\r\nend",
    "你好！请用一句话介绍大语言模型。敢问路在何方？",
    "Emoji: 🙂🚀👩‍💻 and ✨",
    "Ünïcödé façade naïve café — “quotes” …",
    "def add(a, b):\n    return a + b\n",
    "http://example.com/path?q=1&x=y",
    "",
    " ",
    "x  y   z    ",
]

# Mostly text a tokenizer sees, plus arbitrary code points.
TEXT_ALPHABET = st.one_of(
    st.sampled_from(list("abcXYZ019 '.,!?\n\t-_(){}<>:;\"") + ["  ", "'s", "'LL", "\r\n"]),
    st.sampled_from(list("éüñßçøÅ你好世界語言ひらがなカタカナ한국어🙂🚀👍🏽✨")),
    st.characters(blacklist_categories=("Cs",)),
)
random_texts = st.lists(TEXT_ALPHABET, max_size=40).map("".join)


def mlx_metadata(path: Path) -> dict[str, Any]:
    return mx.load(str(path), return_metadata=True)[1]


@pytest.fixture(scope="module")
def smollm2_meta() -> dict[str, Any]:
    return mlx_metadata(SMOLLM2)


@pytest.fixture(scope="module", params=["from_gguf", "from_gguf_metadata"])
def smollm2(request: pytest.FixtureRequest, smollm2_meta: dict[str, Any]) -> Tokenizer:
    if request.param == "from_gguf":
        return Tokenizer.from_gguf(SMOLLM2)
    return Tokenizer.from_gguf_metadata(smollm2_meta, source=str(SMOLLM2))


# ---- SmolLM2 against llama.cpp ------------------------------------------------------------------


@pytest.mark.parametrize("case", FIXTURE["tokenize"], ids=lambda c: c["text"][:20])
def test_llamacpp_tokenize(smollm2: Tokenizer, case: dict[str, Any]) -> None:
    # SmolLM2's GGUF says add_bos_token=False, so add_special_tokens=True adds nothing.
    assert smollm2.encode(case["text"]) == case["ids"]
    assert smollm2.encode(case["text"], add_special_tokens=False) == case["ids"]


@pytest.mark.parametrize("case", FIXTURE["chat_template"], ids=range(3))
def test_llamacpp_chat_template(smollm2: Tokenizer, case: dict[str, Any]) -> None:
    prompt = smollm2.apply_chat_template(case["messages"], add_generation_prompt=True)
    assert prompt == case["prompt"]
    assert smollm2.encode_chat(case["messages"]) == smollm2.encode(case["prompt"])


def test_smollm2_special_tokens(smollm2: Tokenizer, smollm2_meta: dict[str, Any]) -> None:
    assert not smollm2.add_bos_token
    assert smollm2.bos_token_id == 1 and smollm2.bos_token == "<|im_start|>"
    assert smollm2.eos_token_id == 2 and smollm2.eos_token == "<|im_end|>"
    # llama.cpp's end-of-generation set for this file: eos plus <|endoftext|> (found by text).
    assert smollm2.eos_token_ids == frozenset({0, 2})
    types = smollm2_meta["tokenizer.ggml.token_type"].tolist()
    assert smollm2.all_special_ids == frozenset(i for i, t in enumerate(types) if t == 3)
    assert smollm2.vocab_size == 49152
    assert smollm2.token_to_id("Ġworld") == 905 and smollm2.id_to_token(905) == "Ġworld"
    assert smollm2.token_to_id("not-a-token-xyz") is None
    assert smollm2.decode([1, 4093, 198, 6004, 2]) == "user\nhi"
    assert smollm2.decode([1, 4093, 198, 6004, 2], skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>"
    )


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_round_trip(smollm2: Tokenizer, text: str) -> None:
    assert smollm2.decode(smollm2.encode(text)) == text


def test_metadata_reader_matches_mlx(smollm2_meta: dict[str, Any]) -> None:
    ours = read_gguf_metadata(SMOLLM2)
    assert set(ours) == set(smollm2_meta)
    for key, value in smollm2_meta.items():
        expected = value.tolist() if isinstance(value, mx.array) else value
        assert ours[key] == expected, key


# ---- SentencePiece ("llama") vocab against sentencepiece itself --------------------------------

SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny corpus for a tiny tokenizer.",
    "Tokenizers split text into pieces; pieces become ids.",
    "  Leading spaces, trailing spaces  and double  spaces.",
    "Numbers like 1234567890 and 3.14159 appear too.",
    "Café, naïve, façade, Ünïcödé — accents matter.",
    "你好，世界。今天天气很好。",
    "def add(a, b):\n    return a + b",
]


def write_gguf(path: Path, fill: Any) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    fill(writer)
    close_gguf(writer)
    return path


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[spm.SentencePieceProcessor, Path]:
    """A SentencePiece BPE model trained here, and its vocab written to a GGUF file."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS * 20),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.99,
        normalization_rule_name="identity",  # llama.cpp does not normalize
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=["<|user|>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())

    def token_type(i: int) -> int:
        if sp.is_unknown(i):
            return gguf.TokenType.UNKNOWN
        if sp.is_control(i):
            return gguf.TokenType.CONTROL
        if sp.is_byte(i):
            return gguf.TokenType.BYTE
        if sp.id_to_piece(i) == "<|user|>":
            return gguf.TokenType.USER_DEFINED
        return gguf.TokenType.NORMAL

    def fill(w: gguf.GGUFWriter) -> None:
        n = sp.get_piece_size()
        w.add_tokenizer_model("llama")
        w.add_token_list([sp.id_to_piece(i) for i in range(n)])
        w.add_token_scores([sp.get_score(i) for i in range(n)])
        w.add_token_types([token_type(i) for i in range(n)])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_chat_template("{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}")

    return sp, write_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", fill)


@pytest.fixture(scope="module")
def spm_tok(spm_pair: tuple[spm.SentencePieceProcessor, Path]) -> Tokenizer:
    return Tokenizer.from_gguf(spm_pair[1])


@pytest.mark.parametrize("text", TEXTS)
def test_spm_matches_sentencepiece(
    spm_pair: tuple[spm.SentencePieceProcessor, Path], spm_tok: Tokenizer, text: str
) -> None:
    sp = spm_pair[0]
    ids = spm_tok.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)
    assert spm_tok.encode(text) == [1, *ids]  # llama vocab: add_bos_token defaults to true
    assert spm_tok.decode(ids) == sp.decode(ids) == text


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=random_texts)
def test_spm_matches_sentencepiece_random(
    spm_pair: tuple[spm.SentencePieceProcessor, Path], spm_tok: Tokenizer, text: str
) -> None:
    text = text.replace("<|user|>", "")  # sentencepiece places the dummy prefix differently there
    sp = spm_pair[0]
    ids = spm_tok.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)
    assert spm_tok.decode(ids) == sp.decode(ids)


def test_spm_special_tokens_parsed_like_llamacpp(
    spm_pair: tuple[spm.SentencePieceProcessor, Path], spm_tok: Tokenizer
) -> None:
    sp = spm_pair[0]
    # llama.cpp splits special-token text out first and prefixes a space to each text segment
    # that starts the text or follows a special token.
    assert spm_tok.encode("Hi<s>there") == [1, *sp.encode("Hi"), 1, *sp.encode("there")]
    user = sp.piece_to_id("<|user|>")
    assert spm_tok.encode("<|user|>hi", add_special_tokens=False) == [user, *sp.encode("hi")]
    assert spm_tok.decode([1, *sp.encode("Hi"), 2]) == "Hi"
    assert spm_tok.decode([1, *sp.encode("Hi"), 2], skip_special_tokens=False) == "<s> Hi</s>"
    assert spm_tok.bos_token == "<s>" and spm_tok.eos_token_ids == frozenset({2})
    assert spm_tok.is_special(1) and not spm_tok.is_special(user)
    # the template renders the BOS text itself, so encode_chat must not add a second one
    ids = spm_tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids == [1, *sp.encode("Hi")]


# ---- byte-level BPE pre-tokenizers against transformers on the same vocab and merges -----------


def _with(meta: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = dict(meta)
    for key, value in changes.items():
        out[key.replace("__", ".")] = value
    return {k: v for k, v in out.items() if v is not None}


BPE_CORPUS = [
    "In 2024 we shipped 1234567 units; in 1999, 42 and 007.",
    "I'm sure they'll say DON'T, it's what we've seen. You're right, I'd go.",
    "Lines\n\nwith  spaces   and\ttabs...!!! ???\r\n-- ok",
    "naïve café 你好世界 123abc abc123 x1y2z3 🙂🙂",
] * 20
UNREACHABLE = "Ġunreachable"  # in the vocab, but no merge builds it


@pytest.fixture(scope="module")
def trained_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE whose merges cross digits, letters, spaces and punctuation, so any
    difference in the pre-tokenizer split shows up in the ids."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(BPE_CORPUS, trainer)
    state = json.loads(backend.to_str())["model"]
    vocab = dict(state["vocab"])
    vocab[UNREACHABLE] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in state["merges"]]
    return vocab, merges


@pytest.fixture(scope="module")
def bpe_oracles(trained_bpe: tuple[dict[str, int], list[tuple[str, str]]]) -> dict[str, Any]:
    """Each family's split as its own tokenizer defines it, on the same vocab and merges."""
    from transformers import GPT2Tokenizer, Qwen2Tokenizer

    vocab, merges = trained_bpe

    def backend(steps: list[Any], ignore_merges: bool = False) -> Backend:
        tok = Backend(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tok.decoder = decoders.ByteLevel()
        return tok

    # Llama 3's split as published in its tokenizer.json, with ignore_merges as it sets it.
    llama3_regex = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    llama3 = [pre_tokenizers.Split(Regex(llama3_regex), behavior="isolated"), byte_level]
    # SmolLM2's tokenizer.json: single digits, then GPT-2's split
    smollm = [
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]
    return {
        "qwen2": Qwen2Tokenizer(vocab=dict(vocab), merges=list(merges)),
        "gpt-2": GPT2Tokenizer(vocab=dict(vocab), merges=list(merges)),
        "llama-bpe": backend(llama3, ignore_merges=True),
        "smollm": backend(smollm),
    }


@pytest.fixture(scope="module")
def bpe_variants(trained_bpe: tuple[dict[str, int], list[tuple[str, str]]]) -> dict[str, Tokenizer]:
    vocab, merges = trained_bpe
    tokens = sorted(vocab, key=vocab.__getitem__)
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t == "<|endoftext|>" else 1 for t in tokens],
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.add_bos_token": False,
    }
    return {
        pre: Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": pre})
        for pre in ("qwen2", "gpt-2", "llama-bpe", "smollm")
    }


def _oracle_ids(oracle: Any, text: str) -> list[int]:
    if isinstance(oracle, Backend):
        return oracle.encode(text, add_special_tokens=False).ids
    return oracle.encode(text, add_special_tokens=False)


PRE_TYPES = ["qwen2", "gpt-2", "llama-bpe", "smollm"]


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=random_texts)
@pytest.mark.parametrize("pre", PRE_TYPES)
def test_bpe_pre_tokenizers_match_oracles(
    bpe_oracles: dict[str, Any], bpe_variants: dict[str, Tokenizer], pre: str, text: str
) -> None:
    text = unicodedata.normalize("NFC", text)  # Qwen2's tokenizer normalizes to NFC first
    text = text.replace("<|endoftext|>", "")  # the oracles do not all know the special token
    ours = bpe_variants[pre].encode(text, add_special_tokens=False)
    assert ours == _oracle_ids(bpe_oracles[pre], text)
    assert bpe_variants[pre].decode(ours) == bpe_oracles[pre].decode(ours) == text


@pytest.mark.parametrize("text", [*TEXTS, *BPE_CORPUS[:4], "an unreachable word"])
@pytest.mark.parametrize("pre", PRE_TYPES)
def test_bpe_pre_tokenizers_fixed_texts(
    bpe_oracles: dict[str, Any], bpe_variants: dict[str, Tokenizer], pre: str, text: str
) -> None:
    assert bpe_variants[pre].encode(text, add_special_tokens=False) == _oracle_ids(
        bpe_oracles[pre], unicodedata.normalize("NFC", text)
    )


def test_bpe_ignore_merges(bpe_variants: dict[str, Tokenizer]) -> None:
    # llama-bpe takes a whole pre-token found in the vocab even when no merge builds it
    unreachable = bpe_variants["llama-bpe"].token_to_id(UNREACHABLE)
    assert unreachable in bpe_variants["llama-bpe"].encode("an unreachable")
    assert unreachable not in bpe_variants["qwen2"].encode("an unreachable")


def test_bpe_add_bos_defaults(smollm2_meta: dict[str, Any]) -> None:
    # llama.cpp: llama-bpe adds BOS unless the file says otherwise; qwen2 does not.
    llama3 = _with(
        smollm2_meta, tokenizer__ggml__pre="llama-bpe", tokenizer__ggml__add_bos_token=None
    )
    assert Tokenizer.from_gguf_metadata(llama3).encode("hi") == [1, 6004]
    qwen2 = _with(smollm2_meta, tokenizer__ggml__pre="qwen2", tokenizer__ggml__add_bos_token=None)
    assert Tokenizer.from_gguf_metadata(qwen2).encode("hi") == [6004]
    eos = _with(smollm2_meta, tokenizer__ggml__add_eos_token=True)
    assert Tokenizer.from_gguf_metadata(eos).encode("hi") == [6004, 2]


def test_named_chat_templates(smollm2_meta: dict[str, Any]) -> None:
    meta = _with(smollm2_meta, **{"tokenizer.chat_template.tool_use": "TOOLS{{ tools | length }}"})
    tok = Tokenizer.from_gguf_metadata(meta)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == FIXTURE["chat_template"][0]["prompt"]
    assert tok.apply_chat_template(msgs, tools=[{"name": "f"}]) == "TOOLS1"
    assert tok.apply_chat_template(msgs, chat_template="tool_use", tools=[]) == "TOOLS0"


# ---- errors -------------------------------------------------------------------------------------


def test_error_unknown_pre_tokenizer(smollm2_meta: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre='no-such-pre'"):
        Tokenizer.from_gguf_metadata(_with(smollm2_meta, tokenizer__ggml__pre="no-such-pre"))


def test_error_unknown_model(tmp_path: Path) -> None:
    def fill(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("bert")
        w.add_token_list(["[PAD]", "a"])

    path = write_gguf(tmp_path / "bert.gguf", fill)
    with pytest.raises(ValueError, match=r"bert\.gguf.*tokenizer\.ggml\.model='bert'"):
        Tokenizer.from_gguf(path)


def test_error_no_tokenizer_metadata(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bare.gguf", lambda w: w.add_context_length(8))
    with pytest.raises(ValueError, match=r"bare\.gguf.*tokenizer\.ggml\.model is missing"):
        Tokenizer.from_gguf(path)


def test_error_missing_merges_and_scores(smollm2_meta: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.merges is missing"):
        Tokenizer.from_gguf_metadata(_with(smollm2_meta, tokenizer__ggml__merges=None))
    spm_meta = _with(smollm2_meta, tokenizer__ggml__model="llama")
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.scores is missing"):
        Tokenizer.from_gguf_metadata(spm_meta)


def test_error_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ValueError, match=r"model\.gguf: not a GGUF file"):
        Tokenizer.from_gguf(bad)
    truncated = tmp_path / "cut.gguf"
    with open(SMOLLM2, "rb") as f:
        truncated.write_bytes(f.read(5000))
    with pytest.raises(ValueError, match=r"cut\.gguf: corrupt or truncated GGUF file"):
        Tokenizer.from_gguf(truncated)
    with pytest.raises(ValueError, match=r"missing\.gguf"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
