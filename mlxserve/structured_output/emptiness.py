"""Does a Lark grammar's ``start`` rule ever complete? (llguidance does not check.)

A rule is *productive* when one of its alternatives consists only of productive items:
literals, regexes, embedded JSON schemas, optional or starred items, and references to
productive rules. ``start: a`` with ``a: "x" a`` is not: every expansion of ``a`` needs
another ``a``, so no finite text matches, and a request would run to max_tokens.

Only the plain Lark subset is analysed (rules, terminals, literals, regexes, groups,
``[..]``, ``? * + ~``, ``%json``/``%regex`` blocks, token references); a grammar using
anything else (templates, ...) is not judged here and goes to llguidance unchecked.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+|//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<tokref><\[[^\]]*\]>|<[^>\s]+>)
  | (?P<block>%(?:json|regex|lark)\b)
  | (?P<directive>%[a-z]+\b[^\n{]*)
  | (?P<name>[?!]?@?[_A-Za-z][_A-Za-z0-9]*)
  | (?P<range>\.\.)
  | (?P<number>\d+)
  | (?P<punct>[:|()\[\]?*+~.])
    """,
    re.VERBOSE,
)

# Parsed expressions: ("alt", [seq, ...]), ("seq", [item, ...]), ("ref", name), ("ok",).
Expr = tuple


class _Unsupported(Exception):
    """The grammar uses syntax this analysis does not model."""


def unproductive_start(lark: str) -> str | None:
    """Why ``start`` can never complete, or None (it can, or the grammar is not analysed)."""
    try:
        rules = _parse(lark)
    except _Unsupported:
        return None
    if "start" not in rules:
        return None
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, expr in rules.items():
            if name not in productive and _productive(expr, productive, rules):
                productive.add(name)
                changed = True
    if "start" in productive:
        return None
    stuck = sorted(n for n in rules if n not in productive)
    return (
        f"rule 'start' never completes (every expansion of {', '.join(stuck)} needs "
        "another expansion of these rules)"
    )


def _productive(expr: Expr, productive: set[str], rules: dict[str, Expr]) -> bool:
    kind = expr[0]
    if kind == "ok":
        return True
    if kind == "ref":
        return expr[1] in productive or expr[1] not in rules  # imported names count as text
    if kind == "seq":
        return all(_productive(e, productive, rules) for e in expr[1])
    return any(_productive(e, productive, rules) for e in expr[1])  # "alt"


def _tokens(text: str) -> list[tuple[str, str]]:
    out = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise _Unsupported(text[pos : pos + 20])
        kind = m.lastgroup
        pos = m.end()
        if kind == "ws":
            if "\n" in m.group():
                out.append(("nl", "\n"))
            continue
        if kind == "block":  # %json { ... } and friends: one opaque, productive item
            pos = _skip_braces(text, pos)
            out.append(("tokref", m.group()))
            continue
        if kind == "directive" and text.startswith("{", pos):
            pos = _skip_braces(text, pos)  # %llguidance { options }
        out.append((kind, m.group()))
    return out


def _skip_braces(text: str, pos: int) -> int:
    """The position after the balanced {...} block that starts at ``pos`` (after spaces)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos >= len(text) or text[pos] != "{":
        raise _Unsupported("block without braces")
    depth, in_string, escaped = 0, False, False
    for i in range(pos, len(text)):
        c = text[i]
        if in_string:
            escaped = not escaped and c == "\\"
            if c == '"' and not escaped:
                in_string = False
            continue
        if c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise _Unsupported("unbalanced braces")


def _parse(lark: str) -> dict[str, Expr]:
    """name -> expression of every rule and terminal definition."""
    rules: dict[str, Expr] = {}
    lines: list[list[tuple[str, str]]] = [[]]
    for tok in _tokens(lark):
        if tok[0] == "nl":
            lines.append([])
        else:
            lines[-1].append(tok)
    # A definition starts with "name:" (or "name.prio:"); other lines continue it.
    current: list[tuple[str, str]] | None = None
    defs: list[tuple[str, list[tuple[str, str]]]] = []
    for line in lines:
        if not line:
            continue
        if line[0][0] == "directive":
            current = None  # %import, %ignore, %llguidance: no rule body
            continue
        head = _definition_head(line)
        if head is not None:
            name, body = head
            current = body
            defs.append((name, current))
        elif current is not None:
            current.extend(line)
        else:
            raise _Unsupported(line[0][1])
    for name, body in defs:
        expr, rest = _alternatives(body, 0)
        if rest != len(body):
            raise _Unsupported(body[rest][1])
        rules[name] = expr
    return rules


def _definition_head(line: list[tuple[str, str]]) -> tuple[str, list] | None:
    if line[0][0] != "name":
        return None
    i = 1
    if i + 1 < len(line) and line[i] == ("punct", ".") and line[i + 1][0] == "number":
        i += 2  # priority
    if i < len(line) and line[i] == ("punct", ":"):
        return line[0][1].lstrip("?!"), line[i + 1 :]
    return None


def _alternatives(toks: list, i: int) -> tuple[Expr, int]:
    alts = []
    seq, i = _sequence(toks, i)
    alts.append(seq)
    while i < len(toks) and toks[i] == ("punct", "|"):
        seq, i = _sequence(toks, i + 1)
        alts.append(seq)
    return ("alt", alts), i


def _sequence(toks: list, i: int) -> tuple[Expr, int]:
    items = []
    while i < len(toks) and toks[i] not in (("punct", "|"), ("punct", ")"), ("punct", "]")):
        item, i = _item(toks, i)
        items.append(item)
    return ("seq", items), i


def _item(toks: list, i: int) -> tuple[Expr, int]:
    kind, value = toks[i]
    if kind in ("string", "regex", "tokref"):
        atom: Expr = ("ok",)
        i += 1
        if i + 1 < len(toks) and toks[i][0] == "range" and toks[i + 1][0] == "string":
            i += 2  # "a".."z"
    elif kind == "name":
        atom, i = ("ref", value.lstrip("?!")), i + 1
    elif value == "(":
        atom, i = _alternatives(toks, i + 1)
        if i >= len(toks) or toks[i] != ("punct", ")"):
            raise _Unsupported("unclosed (")
        i += 1
    elif value == "[":
        _, i = _alternatives(toks, i + 1)
        if i >= len(toks) or toks[i] != ("punct", "]"):
            raise _Unsupported("unclosed [")
        atom, i = ("ok",), i + 1
    else:
        raise _Unsupported(value)
    while i < len(toks) and toks[i][0] == "punct" and toks[i][1] in "?*+~":
        op = toks[i][1]
        i += 1
        if op in "?*":
            atom = ("ok",)
        elif op == "~":
            if i >= len(toks) or toks[i][0] != "number":
                raise _Unsupported("~ without a count")
            if int(toks[i][1]) == 0:
                atom = ("ok",)
            i += 1
            if i + 1 < len(toks) and toks[i][0] == "range" and toks[i + 1][0] == "number":
                i += 2
    return atom, i
