"""The package layout's import rules, read from the source with ``ast`` so they stay true.

    core/     bookkeeping without arrays         imports no mlx, no other wing
    engine/   requests in, outputs out           may import core, worker, loader, ...
    worker/   everything on the device           never the engine, cli or server
    cli/      one module per sub-command         only cli/main imports the sub-commands
    server/   the HTTP face                      never cli
    loader/, models/, ops/, tokenizer/, cpu/,    none of core, engine, worker, cli, server
    structured_output/, parsers/

Every import counts, also those inside functions (a lazy import is still a dependency);
only ``if TYPE_CHECKING:`` blocks are skipped.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

from tests.paths import ROOT

PACKAGE = ROOT / "mlxserve"
WINGS = ("core", "engine", "worker", "cli", "server")


@cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str) -> str | None:
    """The module an imported name lives in (``a.b.f`` -> ``a.b`` when f is not a module)."""
    mods = modules()
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


@cache
def imported_names(module: str) -> frozenset[str]:
    """Every absolute name ``module`` imports, lazily or not (TYPE_CHECKING blocks skipped)."""
    tree = ast.parse(modules()[module].read_text(encoding="utf-8"))
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0, f"{module}: relative import (use absolute imports)"
                names.update(f"{child.module}.{alias.name}" for alias in child.names)
            visit(child)

    visit(tree)
    return frozenset(names)


def internal_imports(module: str) -> set[str]:
    """The mlxserve modules ``module`` imports."""
    out = {_resolve(n) for n in imported_names(module) if n.split(".")[0] == "mlxserve"}
    return {m for m in out if m and m != module}


def wing(module: str) -> str:
    """``mlxserve.core.scheduler`` -> ``core``; top-level modules are their own wing."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_planted_circle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle() -> None:
    edges = {m: internal_imports(m) for m in modules()}
    assert cycles(edges) == []


def test_no_import_circle_through_package_inits() -> None:
    """Importing ``a.b.c`` runs ``a/b/__init__.py`` first: no circle may pass through it
    across wings (a package importing its own modules is fine)."""
    edges = {m: internal_imports(m) for m in modules()}
    for m in modules():
        parent = m.rpartition(".")[0]
        if parent != "mlxserve" and parent in edges:
            edges[m].add(parent)
    crossing = [c for c in cycles(edges) if len({wing(m) for m in c}) > 1]
    assert crossing == []


LOWER_LAYERS = ("loader", "models", "ops", "tokenizer", "cpu", "structured_output", "parsers")


@pytest.mark.parametrize("layer", LOWER_LAYERS)
def test_lower_layers_import_no_wing(layer: str) -> None:
    bad = {
        m: sorted(i for i in internal_imports(m) if wing(i) in WINGS)
        for m in modules()
        if wing(m) == layer
    }
    assert {m: v for m, v in bad.items() if v} == {}


def test_core_imports_no_mlx_and_no_other_wing() -> None:
    allowed = {"core", "config", "exceptions", "kv_cache_spec", "sampling_params", "utils"}
    for m in modules():
        if wing(m) != "core":
            continue
        assert not [n for n in imported_names(m) if n.split(".")[0] == "mlx"], m
        assert {wing(i) for i in internal_imports(m)} <= allowed, m


def test_worker_does_not_import_the_engine_cli_or_server() -> None:
    for m in modules():
        if wing(m) == "worker":
            assert not {wing(i) for i in internal_imports(m)} & {"engine", "cli", "server"}, m


def test_only_the_cli_imports_the_cli_and_sub_commands_never_import_main() -> None:
    for m in modules():
        imported = internal_imports(m)
        if m == "mlxserve.__main__":  # `python -m mlxserve`: the command's other entry point
            assert imported == {"mlxserve.cli.main"}, imported
        elif wing(m) != "cli":
            assert not [i for i in imported if wing(i) == "cli"], m
        elif m not in ("mlxserve.cli.main", "mlxserve.cli.__main__"):
            assert "mlxserve.cli.main" not in imported, m


def test_leaf_modules_import_nothing_from_the_package() -> None:
    leaves = ("utils", "blas", "gguf_file", "exceptions", "repetition", "kv_cache_spec")
    for leaf in (f"mlxserve.{name}" for name in leaves):
        assert internal_imports(leaf) == set(), leaf


def test_every_package_directory_is_a_regular_package() -> None:
    """find_packages() ships only directories with an __init__.py."""
    for path in PACKAGE.rglob("*.py"):
        if "csrc" in path.parts:
            continue
        assert (path.parent / "__init__.py").exists(), path.parent
