"""Grammar backends compared on one model's vocabulary: why mlxserve uses llguidance.

    PYTHONPATH=. python bench/grammar_backends.py                       # every installed one
    PYTHONPATH=. python bench/grammar_backends.py --backends llguidance --gguf MODEL.gguf

Measured per backend (llguidance, xgrammar, outlines-core; one not installed is skipped):
building its view of the vocabulary, compiling a nested schema (median of 5) and a schema
of 60 $defs, the mask of each next token while a valid instance is walked token by token
(mean and max; every instance token must be allowed), 32 masks at different positions (one
step of a 32-request batch), and what it does with JSON-schema keywords it may not
implement: refuse the schema (what mlxserve wants: a 400 naming it) or compile it and then
accept an instance that violates it (silently wrong output). Measurement only: no backend
is chosen here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "status": {"enum": ["active", "inactive", "pending"]},
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "age", "tags", "address", "status", "scores"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Alice Smith",
    "age": 42,
    "tags": ["a b", "c", "hello world"],
    "address": {"street": "12 Main Street", "city": "Springfield", "zip": "12345"},
    "status": "pending",
    "scores": [1.5, 2, 3.25, -4e3],
}
# Keywords a backend may not implement, each with an instance that violates it.
KEYWORDS = {
    "not": ({"not": {"type": "string"}}, '"abc"'),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]"),
    "contains": ({"type": "array", "contains": {"type": "integer"}}, '["a"]'),
    "if/then/else": (
        {"if": {"type": "string"}, "then": {"minLength": 3}, "else": {"type": "integer"}},
        '"a"',
    ),
}


def big_schema(n: int = 60) -> dict:
    """n object types in $defs, each referenced by a property."""
    fields = {f"f{j}": {"type": ["string", "integer", "null"]} for j in range(8)}
    defs = {f"T{i}": {"type": "object", "properties": fields, "required": ["f0"]} for i in range(n)}
    props = {f"p{i}": {"$ref": f"#/$defs/T{i}"} for i in range(n)}
    return {"$defs": defs, "type": "object", "properties": props, "required": ["p0"]}


def timed(f: Callable[[], Any], repeat: int = 1) -> tuple[float, Any]:
    """(median seconds of ``repeat`` calls, the last result)."""
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def allows(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


class Vocab:
    """The model's vocabulary as the backends take it."""

    def __init__(self, gguf: str | None) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        from mlxserve.loader import default_model_path
        from mlxserve.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(gguf or default_model_path())
        self.json = tok.backend.to_str()
        self.hf = HFTokenizer.from_str(self.json)
        self.size = self.hf.get_vocab_size()
        self.eos = tok.eos_token_id
        self.words = (self.size + 31) // 32

    def ids(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids


def walk(vocab: Vocab, fill: Callable[[np.ndarray], None], consume: Callable[[int], Any]) -> list:
    """Per-token mask times along INSTANCE's tokens; each token must be allowed."""
    row = np.zeros(vocab.words, dtype=np.int32)
    times = []
    for t in vocab.ids(json.dumps(INSTANCE)):
        t0 = time.perf_counter()
        fill(row)
        times.append(time.perf_counter() - t0)
        assert allows(row, t), f"token {t} {vocab.hf.decode([t])!r} refused"
        consume(t)
    fill(row)
    assert allows(row, vocab.eos), "EOS refused after a complete instance"
    return times


def llguidance_numbers(vocab: Vocab) -> dict:
    import llguidance as llg

    init, tok = timed(lambda: llg.LLTokenizer(vocab.json, n_vocab=vocab.size, eos_token=vocab.eos))

    def matcher(schema: dict) -> llg.LLMatcher:
        m = llg.LLMatcher(tok, llg.LLMatcher.grammar_from_json_schema(schema), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(m: llg.LLMatcher) -> Callable[[np.ndarray], None]:
        return lambda row: m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    m = matcher(SCHEMA)
    times = walk(vocab, fill(m), m.consume_token)
    ids = vocab.ids(json.dumps(INSTANCE))
    batch = []
    for i in range(32):
        b = matcher(SCHEMA)
        b.consume_tokens(ids[: (i * 3) % (len(ids) - 1)])
        batch.append(b)
    rows = np.zeros((32, vocab.words), dtype=np.int32)
    batch_s, _ = timed(lambda: [fill(b)(r) for b, r in zip(batch, rows, strict=True)], 20)

    def keyword(schema: dict, bad: str) -> str:
        try:
            m = matcher(schema)
        except ValueError as e:
            return "refused: " + str(e).splitlines()[0][:60]
        return "accepts a violation" if m.consume_tokens(vocab.ids(bad)) else "enforced"

    return {
        "vocab_init_s": init,
        "compile_s": timed(lambda: matcher(SCHEMA), 5)[0],
        "compile_60_defs_s": timed(lambda: matcher(big_schema()), 3)[0],
        "mask_us_mean": 1e6 * statistics.mean(times),
        "mask_us_max": 1e6 * max(times),
        "batch32_ms": 1e3 * batch_s,
        "keywords": {k: keyword(*v) for k, v in KEYWORDS.items()},
    }


def xgrammar_numbers(vocab: Vocab) -> dict:
    import xgrammar as xgr

    def make_info():
        encoded = [vocab.hf.id_to_token(i) or "" for i in range(vocab.size)]
        return xgr.TokenizerInfo(
            encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab.size, stop_token_ids=[vocab.eos]
        )

    init, info = timed(make_info)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False, max_threads=2)

    def compile_schema(schema: dict):
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    compiled = compile_schema(SCHEMA)
    m = xgr.GrammarMatcher(compiled)
    times = walk(vocab, lambda row: m.fill_next_token_bitmask(row[None, :]), m.accept_token)
    ids = vocab.ids(json.dumps(INSTANCE))
    batch = []
    for i in range(32):
        b = xgr.GrammarMatcher(compiled)
        for t in ids[: (i * 3) % (len(ids) - 1)]:
            b.accept_token(t)
        batch.append(b)
    rows = np.zeros((32, vocab.words), dtype=np.int32)
    batch_s, _ = timed(
        lambda: [b.fill_next_token_bitmask(rows, i) for i, b in enumerate(batch)], 20
    )

    def keyword(schema: dict, bad: str) -> str:
        try:
            k = xgr.GrammarMatcher(compile_schema(schema))
        except Exception as e:  # noqa: BLE001 -- any refusal is the answer
            return "refused: " + str(e).splitlines()[0][:60]
        ok = all(k.accept_token(t) for t in vocab.ids(bad)) and k.accept_token(vocab.eos)
        return "accepts a violation" if ok else "enforced"

    return {
        "vocab_init_s": init,
        "compile_s": timed(lambda: compile_schema(SCHEMA), 5)[0],
        "compile_60_defs_s": timed(lambda: compile_schema(big_schema()), 3)[0],
        "mask_us_mean": 1e6 * statistics.mean(times),
        "mask_us_max": 1e6 * max(times),
        "batch32_ms": 1e3 * batch_s,
        "keywords": {k: keyword(*v) for k, v in KEYWORDS.items()},
    }


def outlines_numbers(vocab: Vocab) -> dict:
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    def make_vocabulary():
        byte_of = _byte_decoder()
        tokens: dict[bytes, list[int]] = {}
        for text, i in vocab.hf.get_vocab().items():
            if i != vocab.eos and all(c in byte_of for c in text):
                tokens.setdefault(bytes(byte_of[c] for c in text), []).append(i)
        return oc.Vocabulary(vocab.eos, tokens)

    init, v = timed(make_vocabulary)
    # The regex of a schema has fixed whitespace: the instance is written that way.
    compile_s, index = timed(lambda: oc.Index(build_regex_from_schema(json.dumps(SCHEMA)), v))
    defs_s, _ = timed(lambda: oc.Index(build_regex_from_schema(json.dumps(big_schema(8))), v))
    guide = oc.Guide(index)
    times = []
    for t in vocab.ids(json.dumps(INSTANCE, separators=(",", ":"))):
        t0 = time.perf_counter()
        allowed = guide.get_tokens()
        times.append(time.perf_counter() - t0)
        if t not in allowed:
            break
        guide.advance(t)
    return {
        "vocab_init_s": init,
        "compile_s": compile_s,
        "compile_8_defs_s (60 did not finish)": defs_s,
        "mask_us_mean": 1e6 * statistics.mean(times),
        "mask_us_max": 1e6 * max(times),
        "grammars": "regular languages only (no recursion, no context-free grammars)",
    }


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable character -> the byte it stands for."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


BACKENDS = {
    "llguidance": ("llguidance", llguidance_numbers),
    "xgrammar": ("xgrammar", xgrammar_numbers),
    "outlines-core": ("outlines_core", outlines_numbers),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--json", default=None, help="write the numbers here")
    args = p.parse_args(argv)
    vocab = Vocab(args.gguf)
    print(f"vocabulary: {vocab.size} tokens")
    results = {}
    for name in args.backends.split(","):
        module, measure = BACKENDS[name]
        if importlib.util.find_spec(module) is None:
            print(f"{name}: not installed, skipped")
            continue
        results[name] = measure(vocab)
        print(name, json.dumps(results[name], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
