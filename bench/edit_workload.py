"""The code-editing workload of bench/spec_decode.py: a ~1,500-token Python file, one rename
asked, in several prompt shapes, and a score of what the model did with it.

Shapes (each a prompt text; the chat ones use the model's chat template):
- ``chat``: the user asks for the whole file back with the rename; the assistant's turn
  starts empty (the shape of the earlier edit workload; a 135M model tends to describe the
  file instead of returning it).
- ``prefill``: the same request, the assistant's reply pre-started with the code fence and
  the file's first line (response prefill, as editing agents do with small models: vLLM's
  ``continue_final_message``, Anthropic's assistant prefill).
- ``system``: ``prefill`` plus a system prompt saying the assistant is a code editor that
  returns whole files.
- ``completion``: no chat template: the file, the instruction, then "the updated file" and
  the fence with the first line, for the model to continue.
- ``copy``: "repeat this file exactly", reply pre-started like ``prefill``: the upper bound
  of n-gram drafts at this context (no change to make).
"""

from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "mlxserve" / "core" / "block_pool.py"
EDIT_TOKENS = 1500
OLD_NAME, NEW_NAME = "num_free_blocks", "free_count"
ASK = (
    f"Here is a Python file. Return the whole file unchanged, except rename the attribute "
    f"`{OLD_NAME}` to `{NEW_NAME}` everywhere. Output only the code."
)
SYSTEM = (
    "You are a code editor. You return the complete edited file in one ```python block, "
    "every line of it, changing only what the user asks."
)
COPY_ASK = "Repeat this Python file exactly, from its first line. Output only the code."
SHAPES = ("chat", "prefill", "system", "completion", "copy")


@functools.lru_cache(maxsize=4)
def edit_source(tokenizer) -> str:
    """~EDIT_TOKENS tokens of mlxserve's block pool, cut at a line boundary (the most
    lines that fit: token counts grow with the lines, so a bisection finds them)."""
    lines = SOURCE.read_text().splitlines(keepends=True)
    lo, hi = 0, len(lines)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.encode("".join(lines[:mid]))) <= EDIT_TOKENS:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo])


def expected_file(source: str) -> str:
    """The file as the edit should return it (the attribute renamed, nothing else)."""
    return re.sub(rf"\b{OLD_NAME}\b", NEW_NAME, source)


def reply_start(source: str) -> str:
    """What the prefilled shapes put at the start of the assistant's reply."""
    return "```python\n" + source.splitlines(keepends=True)[0]


def render(tokenizer, messages: list[dict], prefill: str | None) -> str:
    """Chat messages as prompt text; with ``prefill`` the assistant's reply continues it."""
    if prefill is None:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    messages = [*messages, {"role": "assistant", "content": prefill}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )


def prompt(tokenizer, shape: str, source: str | None = None) -> tuple[str, str]:
    """(prompt text, the part of the answer the prompt already holds) for ``shape``;
    ``source``: the file (default: edit_source)."""
    source = source or edit_source(tokenizer)
    fenced = "```python\n" + source + "```"
    start = reply_start(source)
    user = {"role": "user", "content": f"{ASK}\n\n{fenced}"}
    if shape == "chat":
        return render(tokenizer, [user], None), ""
    if shape == "prefill":
        return render(tokenizer, [user], start), start
    if shape == "system":
        return render(tokenizer, [{"role": "system", "content": SYSTEM}, user], start), start
    if shape == "completion":
        text = f"# {SOURCE.name}\n{fenced}\n\n# Task: {ASK}\n\n# The updated file:\n{start}"
        return text, start
    if shape == "copy":
        copy = {"role": "user", "content": f"{COPY_ASK}\n\n{fenced}"}
        return render(tokenizer, [copy], start), start
    raise ValueError(f"edit shape must be one of {', '.join(SHAPES)}, got {shape!r}")


def code_block(answer: str) -> tuple[str, bool]:
    """The answer's first ```python block (to its closing fence, or to the end: cut off)."""
    at = answer.find("```python\n")
    if at < 0:
        return "", False
    body = answer[at + len("```python\n") :]
    end = body.find("```")
    return (body, False) if end < 0 else (body[:end], True)


def score(tokenizer, shape: str, given: str, generated: str, source: str | None = None) -> dict:
    """What the model did with the file (``source``, default edit_source): tokens of the
    expected file it reproduced, and the rename."""
    source = source or edit_source(tokenizer)
    want = source if shape == "copy" else expected_file(source)
    code, closed = code_block(given + generated)
    want_ids, got_ids = tokenizer.encode(want), tokenizer.encode(code)
    match = difflib.SequenceMatcher(None, want_ids, got_ids, autojunk=False)
    same = sum(b.size for b in match.get_matching_blocks())
    prefix = next(
        (i for i, (a, b) in enumerate(zip(want_ids, got_ids, strict=False)) if a != b),
        min(len(want_ids), len(got_ids)),
    )
    uses = len(re.findall(rf"\b{OLD_NAME}\b", source))
    lines = code.splitlines()
    return {
        "file_tokens": len(want_ids),
        "code_tokens": len(got_ids),
        "reproduced": same,
        "exact_prefix": prefix,
        "closed": closed,
        "lines": f"{len(lines)} of {len(want.splitlines())}",
        "uses": uses,
        "renamed": len(re.findall(rf"\b{NEW_NAME}\b", code)),
        "old_left": len(re.findall(rf"\b{OLD_NAME}\b", code)),
    }


def describe(s: dict, shape: str) -> str:
    """One line: what the model did with the file."""
    if not s["code_tokens"]:
        return "returned no code block"
    out = (
        f"reproduced {s['reproduced']:,} of {s['file_tokens']:,} tokens of the "
        f"{'file' if shape == 'copy' else 'edited file'} ({s['exact_prefix']:,} before "
        f"the first difference; {s['lines']} lines{'' if s['closed'] else ', cut off'})"
    )
    if shape != "copy":
        out += f", {s['renamed']} renamed / {s['old_left']} old of {s['uses']} uses"
    return out
