"""Streaming text: the incremental detokenizer against full decodes, stop strings against a
character-by-character reference."""

from __future__ import annotations

import io

import pytest
import sentencepiece as spm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxserve.sampling_params import SamplingParams
from mlxserve.tokenizer import IncrementalDetokenizer, StopChecker, TextStream, Tokenizer
from tests.paths import SMOLLM2_GGUF

SMOLLM2 = SMOLLM2_GGUF
FFFD = "\ufffd"
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

text_chars = st.one_of(
    st.sampled_from(list("ab Z9 .,'\n\t") + ["  ", "'s"]),
    st.sampled_from(list("éñ你好語ひカ한🙂🚀👍🏽✨")),
    st.characters(blacklist_categories=("Cs",)),
)
texts = st.lists(text_chars, max_size=30).map("".join)


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf(SMOLLM2)


@pytest.fixture(scope="module")
def spm_tok() -> Tokenizer:
    """A SentencePiece vocab with byte fallback, as GGUF metadata (the "llama" vocab type)."""
    corpus = ["The capital of France is Paris.", "Hello world, 你好世界。", "naïve café 123"] * 30
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        vocab_size=340,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    types = [
        2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
        for i in range(n)
    ]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": types,
    }
    return Tokenizer.from_gguf_metadata(meta)


def tokenizer_of(name: str, request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(name)


def cut(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Split ids into chunks of the given sizes (cycled), like tokens arriving per engine step."""
    chunks, i, k = [], 0, 0
    while i < len(ids):
        size = sizes[k % len(sizes)] if sizes else 1
        chunks.append(ids[i : i + size])
        i, k = i + size, k + 1
    return chunks


def check_stream(tok: Tokenizer, ids: list[int], sizes: list[int], skip: bool) -> None:
    """Deltas join to decode(ids); what was shown is never revised; no premature U+FFFD."""
    final = tok.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    shown, seen = "", []
    for chunk in cut(ids, sizes):
        delta = detok.step(chunk)
        seen.extend(chunk)
        shown += delta
        assert final.startswith(shown)
        # a U+FFFD is only shown when the full decode of the ids so far has it there too
        assert FFFD not in delta or tok.decode(seen, skip_special_tokens=skip).startswith(shown)
    shown += detok.flush()
    assert shown == final == detok.text
    assert detok.token_ids == ids


@SETTINGS
@given(text=texts, sizes=st.lists(st.integers(1, 4), max_size=5))
@pytest.mark.parametrize("name", ["smollm2", "spm_tok"])
@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_random_texts(
    request: pytest.FixtureRequest, name: str, skip: bool, text: str, sizes: list[int]
) -> None:
    tok = tokenizer_of(name, request)
    ids = tok.encode(text, add_special_tokens=True)
    check_stream(tok, ids, sizes, skip)


_POOLS: dict[int, list[int]] = {}


def id_pool(tok: Tokenizer) -> list[int]:
    """Ids that stress streaming: single-byte tokens (UTF-8 lead/continuation bytes), specials,
    space-led pieces."""
    if id(tok) in _POOLS:
        return _POOLS[id(tok)]
    pool = _POOLS[id(tok)] = sorted(tok.all_special_ids)
    for i in range(tok.vocab_size):
        token = tok.id_to_token(i) or ""
        is_byte_token = token.startswith("<0x") and token.endswith(">")
        if is_byte_token or (len(token) == 1 and ord(token) >= 0x80) or token[:1] in ("Ġ", "▁"):
            pool.append(i)
    return pool


@SETTINGS
@given(data=st.data(), sizes=st.lists(st.integers(1, 3), max_size=4))
@pytest.mark.parametrize("name", ["smollm2", "spm_tok"])
@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_random_ids(
    request: pytest.FixtureRequest, name: str, skip: bool, data: st.DataObject, sizes: list[int]
) -> None:
    tok = tokenizer_of(name, request)
    pool = id_pool(tok)
    any_id = st.integers(0, tok.vocab_size - 1)
    ids = data.draw(st.lists(st.one_of(st.sampled_from(pool), any_id), max_size=25))
    check_stream(tok, ids, sizes, skip)


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, built from its definition."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 0x100 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def reference_decode(tok: Tokenizer, ids: list[int], skip: bool, byte_level: bool) -> str:
    """Token strings -> bytes -> lossy UTF-8, written out by hand for both vocab kinds."""
    table = gpt2_byte_decoder()
    out = bytearray()
    for i in ids:
        token = tok.id_to_token(i)
        if token is None or (skip and tok.is_special(i)):
            continue
        if byte_level:
            mapped = all(c in table for c in token)
            out += bytes(table[c] for c in token) if mapped else token.encode()
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            out.append(int(token[3:5], 16))
        else:
            out += token.replace("▁", " ").encode()
    text = out.decode("utf-8", errors="replace")
    return text if byte_level or not text.startswith(" ") else text[1:]


@SETTINGS
@given(data=st.data())
@pytest.mark.parametrize("name", ["smollm2", "spm_tok"])
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_reference(
    request: pytest.FixtureRequest, name: str, skip: bool, data: st.DataObject
) -> None:
    tok = tokenizer_of(name, request)
    any_id = st.integers(0, tok.vocab_size - 1)
    ids = data.draw(st.lists(st.one_of(st.sampled_from(id_pool(tok)), any_id), max_size=25))
    assert tok.decode(ids, skip_special_tokens=skip) == reference_decode(
        tok, ids, skip, byte_level=name == "smollm2"
    )


def test_detokenizer_holds_split_characters(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("你好🙂")  # 你 and 🙂 are each split over several byte tokens
    detok = IncrementalDetokenizer(smollm2)
    deltas = [detok.step([i]) for i in ids]
    assert [d for d in deltas if d] == ["你", "好", "🙂"]
    assert all(FFFD not in d for d in deltas)
    # an unfinished character at the end becomes U+FFFD only when generation ends
    detok = IncrementalDetokenizer(smollm2)
    assert detok.step(ids[:1]) == ""
    assert detok.flush() == smollm2.decode(ids[:1]) == FFFD


@pytest.mark.parametrize("name", ["smollm2", "spm_tok"])
@pytest.mark.parametrize(
    ("prompt", "output"), [("The capital of France is", " Paris."), ("", "Hi")]
)
def test_detokenizer_prompt_context_keeps_leading_space(
    request: pytest.FixtureRequest, name: str, prompt: str, output: str
) -> None:
    tok = tokenizer_of(name, request)
    prompt_ids = tok.encode(prompt)
    full = tok.encode(prompt + output)
    assert full[: len(prompt_ids)] == prompt_ids
    out_ids = full[len(prompt_ids) :]
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids)
    shown = "".join(detok.step([i]) for i in out_ids) + detok.flush()
    expected = tok.decode(full)[len(tok.decode(prompt_ids)) :]
    assert shown == expected
    if prompt:
        assert shown == output  # " Paris." keeps its space even for SentencePiece's "▁Paris"


@SETTINGS
@given(prompt=texts, output=texts)
def test_detokenizer_prompt_context_random(spm_tok: Tokenizer, prompt: str, output: str) -> None:
    prompt_ids = spm_tok.encode(prompt)
    out_ids = spm_tok.encode(output, add_special_tokens=False)
    ids = prompt_ids + out_ids
    prompt_text = spm_tok.decode(prompt_ids)
    full_text = spm_tok.decode(ids)
    if FFFD in full_text or not full_text.startswith(prompt_text):
        return  # prompt and output do not meet at a character boundary; nothing to compare
    detok = IncrementalDetokenizer(spm_tok, prompt_token_ids=prompt_ids)
    shown = "".join(detok.step([i]) for i in out_ids) + detok.flush()
    assert shown == full_text[len(prompt_text) :]


def test_detokenizer_decodes_small_windows(smollm2: Tokenizer) -> None:
    """Per-step work does not grow with the output: each decode sees a few tokens."""
    ids = smollm2.encode("Streaming text, one token at a time; 你好世界 🙂. " * 60)
    detok = IncrementalDetokenizer(smollm2)
    windows: list[int] = []
    real_decode = detok._decode

    def counting_decode(window: list[int]) -> str:
        windows.append(len(window))
        return real_decode(window)

    detok._decode = counting_decode  # type: ignore[method-assign]
    shown = "".join(detok.step([i]) for i in ids) + detok.flush()
    assert shown == smollm2.decode(ids)
    assert len(ids) > 700 and max(windows) <= 6


# ---- stop strings -------------------------------------------------------------------------------


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Text seen one character at a time: stop as soon as any stop string is complete."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end - len(stop)] + (stop if include else ""), stop
    return text, None


def run_stops(pieces: list[str], stops: list[str], include: bool) -> tuple[str, str | None]:
    checker = StopChecker(stops, include_stop_str_in_output=include)
    expected, _ = reference_stop("".join(pieces), stops, include)
    shown = ""
    for piece in pieces:
        shown += checker.step(piece)
        assert expected.startswith(shown)  # nothing shown is later found to be a stop string
    shown += checker.flush()
    return shown, checker.stop_str


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="ab🙂c", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="ab🙂c", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_stop_checker_matches_reference(pieces: list[str], stops: list[str], include: bool) -> None:
    assert run_stops(pieces, stops, include) == reference_stop("".join(pieces), stops, include)


@pytest.mark.parametrize(
    ("pieces", "stops", "include", "expected"),
    [
        (["Hello wo", "rld! Bye"], ["world"], False, ("Hello ", "world")),  # spans pieces
        (["Hello wo", "rld! Bye"], ["world"], True, ("Hello world", "world")),
        (["STOP", " and more"], ["STOP"], False, ("", "STOP")),  # at the very start
        (["S", "T", "O", "P"], ["STOP"], True, ("STOP", "STOP")),
        (["abcd"], ["abcd", "bc"], False, ("a", "bc")),  # the match that ends first wins
        (["xabcd"], ["abcd", "cd"], True, ("xabcd", "abcd")),  # same end: the longer one
        (["a", "b", "a", "b", "c"], ["abc"], False, ("ab", "abc")),  # overlapping prefixes
        (["温度是", "21°", "C。结束"], ["。结束"], False, ("温度是21°C", "。结束")),
        (["emoji 🙂", "🚀 end"], ["🙂🚀"], True, ("emoji 🙂🚀", "🙂🚀")),
        (["no stop he", "re, Do"], ["Don't"], False, ("no stop here, Do", None)),  # flushed
    ],
)
def test_stop_checker_cases(
    pieces: list[str], stops: list[str], include: bool, expected: tuple[str, str | None]
) -> None:
    assert run_stops(pieces, stops, include) == expected


def test_stop_checker_holds_back_possible_starts() -> None:
    checker = StopChecker(["</answer>", "STOP"])
    assert checker.step("result: 42 </ans") == "result: 42 "
    assert checker.held_text == "</ans"
    assert checker.step("wer") == "" and checker.held_text == "</answer"
    assert checker.step(">") == ""
    assert checker.stopped and checker.stop_str == "</answer>"
    assert checker.step("more") == "" and checker.flush() == ""
    checker = StopChecker(["</answer>"])
    assert checker.step("a </ans") == "a "
    assert checker.step("wers") == "</answers"  # no longer a possible start: released
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker(["ok", ""])


# ---- TextStream: tokens in, visible text out ---------------------------------------------------


def stream_ids(stream: TextStream, ids: list[int]) -> str:
    out = ""
    for i in ids:
        out += stream.step([i])
        if stream.stopped:
            break
    return out + stream.finish()


def test_text_stream_stop_spanning_tokens(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("The answer is 42.\n\nDone. 你好")
    params = SamplingParams(stop=["42.\n"], include_stop_str_in_output=False)
    stream = TextStream.for_request(smollm2, params)
    assert stream_ids(stream, ids) == "The answer is "
    assert stream.stop_str == "42.\n" and stream.text == "The answer is "
    stream = TextStream(smollm2, stop=["42.\n"], include_stop_str_in_output=True)
    assert stream_ids(stream, ids) == "The answer is 42.\n"
    stream = TextStream(smollm2, stop=["好"])  # a stop string inside a split character
    assert stream_ids(stream, ids) == "The answer is 42.\n\nDone. 你"


def test_text_stream_special_tokens_and_flush(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("<|im_start|>assistant\nSure, Do")
    stream = TextStream(smollm2, stop=["Don't"])
    assert stream_ids(stream, ids) == "assistant\nSure, Do"  # the held "Do" is flushed at the end
    assert not stream.stopped
    stream = TextStream(smollm2, stop=["<|im_start|>"], skip_special_tokens=False)
    assert stream_ids(stream, ids) == "" and stream.stop_str == "<|im_start|>"
