"""Structured outputs, the pieces: params, grammar compiling and its errors, the token
bitmask (against hand-derived token sets), the sampler's masking, regex and emptiness
rewrites. No model runs here (the tiny test tokenizer only)."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.exceptions import ParameterError
from mlxserve.sampling_params import SamplingParams, StructuredOutputsParams
from mlxserve.structured_output.emptiness import unproductive_start
from mlxserve.structured_output.grammar import GrammarCompiler, bitmask_words
from mlxserve.structured_output.sources import ascii_classes
from mlxserve.tokenizer import Tokenizer
from mlxserve.worker.sampler import SamplingState, apply_bitmask, make_sampling_batch, sample
from tests.engine_helpers import VOCAB_SIZE, write_tokenizer

EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB_SIZE)


def allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return {int(t) for t in np.flatnonzero(bits[:VOCAB_SIZE])}


def mask_of(state) -> set[int]:
    row = np.full(bitmask_words(VOCAB_SIZE), -1, dtype=np.int32)
    state.fill_bitmask(row)
    return allowed(row)


# ----------------------------------------------------------------------------- params
def test_params_take_exactly_one_constraint() -> None:
    with pytest.raises(ParameterError, match="exactly one") as e:
        StructuredOutputsParams(regex="a", choice=["a"])
    assert e.value.parameter == "structured_outputs"
    with pytest.raises(ParameterError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(ParameterError) as e:
        StructuredOutputsParams(regex="a", structural_tag="{}")
    assert e.value.parameter == "structured_outputs.structural_tag"
    with pytest.raises(ParameterError) as e:
        StructuredOutputsParams(choice=[])
    assert e.value.parameter == "structured_outputs.choice"
    with pytest.raises(ParameterError) as e:
        StructuredOutputsParams(choice=["a", 1])
    assert e.value.parameter == "structured_outputs.choice"
    with pytest.raises(ParameterError) as e:
        SamplingParams(structured_outputs={"json": {}})
    assert e.value.parameter == "structured_outputs"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_json_takes_a_dict_a_string_or_a_pydantic_model() -> None:
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str
        population: int

    from_model = StructuredOutputsParams(json=City).schema
    assert from_model["required"] == ["name", "population"]
    text = StructuredOutputsParams(json='{"type": "integer"}')
    assert text.schema == {"type": "integer"}
    assert text.cache_key() == StructuredOutputsParams(json={"type": "integer"}).cache_key()
    for bad, what in (('{"type": ', "not valid JSON"), ("[1]", "must be a JSON schema")):
        with pytest.raises(ParameterError, match=what):
            _ = StructuredOutputsParams(json=bad).schema
    with pytest.raises(ParameterError, match="no output matches"):
        _ = StructuredOutputsParams(json="false").schema


# ---------------------------------------------------------------------------- compile
@pytest.mark.parametrize(
    ("params", "parameter", "message"),
    [
        (dict(json={"type": "strin"}), "structured_outputs.json", "strin"),
        (dict(json={"$ref": "#/$defs/Missing"}), "structured_outputs.json", "Missing"),
        (
            dict(json={"type": "array", "uniqueItems": True}),
            "structured_outputs.json",
            "uniqueItems",
        ),
        (
            dict(json={"type": "integer", "minimum": 5, "maximum": 1}),
            "structured_outputs.json",
            "5",
        ),
        (dict(regex="(abc"), "structured_outputs.regex", "unclosed group"),
        (dict(regex="a(?=b)"), "structured_outputs.regex", "look-around"),
        (dict(regex="[^\\s\\S]"), "structured_outputs.regex", "cannot match anything"),
        (dict(grammar="start: foo"), "structured_outputs.grammar", "foo"),
        (dict(grammar='start: a\na: "x" a'), "structured_outputs.grammar", "never completes"),
        (dict(grammar='root ::= a\na ::= "x" a'), "structured_outputs.grammar", "never completes"),
    ],
)
def test_invalid_constraints_are_parameter_errors_naming_the_problem(
    compiler, params, parameter, message
) -> None:
    with pytest.raises(ParameterError, match=re.escape(message)) as e:
        compiler.compile(StructuredOutputsParams(**params))
    assert e.value.parameter == parameter


def test_compiled_grammars_are_cached_by_value(compiler) -> None:
    a = compiler.compile(StructuredOutputsParams(json={"type": "object"}))
    b = compiler.compile(StructuredOutputsParams(json='{"type": "object"}'))
    c = compiler.compile(StructuredOutputsParams(json_object=True))
    assert a is b and a is not c


# ------------------------------------------------------------------ bitmasks and state
def test_choice_bitmask_is_the_tokens_that_keep_a_choice_reachable(compiler, tokenizer) -> None:
    choices = ["yes", "no", "maybe"]
    end = frozenset({tokenizer.eos_token_id})
    state = compiler.compile(StructuredOutputsParams(choice=choices)).new_state(end)
    text = ""
    for _ in range(10):
        # Hand-derived oracle: token t may come next iff text + t is a prefix of a choice;
        # the end token iff text is a choice.
        expected = {
            t
            for t in range(VOCAB_SIZE)
            if not tokenizer.is_special(t)
            and (piece := tokenizer.decode([t]))
            and any(c.startswith(text + piece) for c in choices)
        }
        if text in choices:
            expected.add(tokenizer.eos_token_id)
        got = mask_of(state)
        assert got == expected, (text, got ^ expected)
        if text == "maybe":
            assert state.is_terminated
            return
        # Follow "maybe" with its longest allowed token (the model's choice, say).
        nxt = max(
            (t for t in got if "maybe".startswith(text + tokenizer.decode([t]))),
            key=len_of(tokenizer),
        )
        state.accept(nxt)
        text += tokenizer.decode([nxt])
    raise AssertionError("never terminated")


def len_of(tokenizer):
    return lambda t: len(tokenizer.decode([t]))


def test_end_tokens_are_allowed_only_when_the_grammar_can_end(compiler, tokenizer) -> None:
    stop = tokenizer.token_to_id("<|endoftext|>")
    ends = frozenset({tokenizer.eos_token_id, stop})
    state = compiler.compile(StructuredOutputsParams(regex="ab(c)?")).new_state(ends)
    assert not mask_of(state) & ends
    for t in tokenizer.encode("ab", add_special_tokens=False):
        state.accept(t)
    assert ends <= mask_of(state)  # "ab" may end the output, or "c" may follow
    assert not state.is_terminated
    state.accept(tokenizer.encode("c", add_special_tokens=False)[0])
    assert mask_of(state) == ends and state.is_terminated
    state.accept(stop)  # an end token is not fed to the grammar
    with pytest.raises(ValueError, match="rejected"):
        fresh = compiler.compile(StructuredOutputsParams(regex="ab(c)?")).new_state(ends)
        fresh.accept(tokenizer.encode("c", add_special_tokens=False)[0])


def test_a_grammar_can_start_after_a_token_sequence(compiler, tokenizer) -> None:
    from mlxserve.structured_output.grammar import StructuredOutputRequest

    grammar = compiler.compile(StructuredOutputsParams(choice=["no"]))
    state = StructuredOutputRequest(grammar, b"</think>").new_state(frozenset({0}))
    # The trigger spread over several tokens of the output.
    assert len(tokenizer.encode("</think>", add_special_tokens=False)) > 1
    for t in tokenizer.encode("The quick </think>", add_special_tokens=False):
        assert not state.is_active and len(mask_of(state)) == VOCAB_SIZE  # free text
        state.accept(t)
    assert state.is_active
    assert mask_of(state) == {t for t in range(VOCAB_SIZE) if tokenizer.decode([t]) in ("n", "no")}


def test_apply_bitmask_masks_only_disallowed_tokens_and_leaves_free_rows_exact() -> None:
    rng = np.random.default_rng(0)
    vocab = 70  # three words, the last one partial
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    keep = rng.random((3, vocab)) < 0.3
    keep[1] = True  # a row without a grammar: every bit set
    bits = np.zeros((3, 3 * 32), dtype=np.uint8)
    bits[:, :vocab] = keep
    bits[1, :] = 1
    words = np.packbits(bits, axis=-1, bitorder="little").view(np.int32)
    out = np.array(apply_bitmask(mx.array(logits), mx.array(words)))
    expected = np.where(keep, logits, -np.inf)
    np.testing.assert_array_equal(out, expected)


def test_masked_sampling_picks_only_allowed_tokens_greedy_and_seeded() -> None:
    vocab = 40
    logits = np.tile(np.linspace(0, 1, vocab, dtype=np.float32), (4, 1))
    keep = np.zeros((4, 64), dtype=np.uint8)
    keep[:, [3, 7, 11]] = 1
    words = np.packbits(keep, axis=-1, bitorder="little").view(np.int32)
    states = [
        SamplingState(SamplingParams(temperature=t, seed=s), s, [])
        for t, s in ((0.0, 0), (1.0, 1), (1.0, 2), (5.0, 3))
    ]
    batch = make_sampling_batch(states, vocab)
    batch.bitmask = mx.array(words)
    out = np.array(sample(mx.array(logits), batch).token_ids).tolist()
    assert out[0] == 11  # greedy: the best allowed token
    assert set(out) <= {3, 7, 11}


# ---------------------------------------------------------------- rewrites (hand-made)
@pytest.mark.parametrize(
    ("regex", "expected"),
    [
        (r"\d{3}-\d{4}", "[0-9]{3}-[0-9]{4}"),
        (r"[\d.]+", "[0-9.]+"),
        (r"\D\W", "[^0-9][^0-9A-Za-z_]"),
        (r"[^\D]", r"[^\D]"),  # a negated class inside [...] stays as written
        (r"\\d", r"\\d"),  # an escaped backslash, then a literal d
        (r"[]\d]", "[]0-9]"),
        (r"\p{L}\s\w", r"\p{L}\s[0-9A-Za-z_]"),
    ],
)
def test_ascii_classes(regex: str, expected: str) -> None:
    assert ascii_classes(regex) == expected


@pytest.mark.parametrize(
    ("lark", "stuck"),
    [
        ('start: a\na: "x" a', True),
        ('start: "a" start | "b"', False),
        ('start: x+\nx: "a" x', True),
        ('start: x*\nx: "a" x', False),
        ('start: a b\na: "x"\nb: b "y"\n  | b b', True),
        ("start: x~0..3\nx: x", False),
        ('%import common.NUMBER\nstart: NUMBER | "x" start', False),
        ('start: "<call>" %json { "type": "object", "x": "}" } "</call>" start', True),
        ('start: [a] "z"\na: a', False),
        ("start: a{x}\n", None),  # templates are not analysed
    ],
)
def test_unproductive_start(lark: str, stuck: bool | None) -> None:
    result = unproductive_start(lark)
    if stuck:
        assert result is not None and "never completes" in result
    else:
        assert result is None
