"""The package layout's import rules, read from the source with ``ast`` so they stay true.

    core/     bookkeeping without arrays         imports no mlx, no other wing
    engine/   requests in, outputs out           may import core, worker, loader, ...
    worker/   everything on the device           never the engine, cli or server
    cli/      one module per sub-command         only cli/main imports the sub-commands
    server/   the HTTP face                      never cli
    loader/, models/, ops/, tokenizer/, cpu/,    none of core, engine, worker, cli, server
    structured_output/, parsers/
    models/                                      architecture only: never the CPU backend
    os.environ                                   read only by the config and CLI layer

Every import counts, also those inside functions (a lazy import is still a dependency);
``if TYPE_CHECKING:`` blocks are skipped by the layer rules, but not by the circle check (a
type-only circle still means two modules that cannot be read apart).
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
def tree_of(module: str) -> ast.Module:
    return ast.parse(modules()[module].read_text(encoding="utf-8"))


@cache
def imported_names(module: str, type_only_too: bool = False) -> frozenset[str]:
    """Every absolute name ``module`` imports, lazily or not (TYPE_CHECKING blocks skipped
    unless ``type_only_too``)."""
    tree = tree_of(module)
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            is_type_only = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            if is_type_only and not type_only_too:
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0, f"{module}: relative import (use absolute imports)"
                names.update(f"{child.module}.{alias.name}" for alias in child.names)
            visit(child)

    visit(tree)
    return frozenset(names)


def internal_imports(module: str, type_only_too: bool = False) -> set[str]:
    """The mlxserve modules ``module`` imports."""
    names = imported_names(module, type_only_too)
    out = {_resolve(n) for n in names if n.split(".")[0] == "mlxserve"}
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


def test_no_import_circle_even_through_type_only_imports() -> None:
    edges = {m: internal_imports(m, type_only_too=True) for m in modules()}
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
    leaves = ("utils", "cpu.blas", "gguf_file", "exceptions", "repetition", "kv_cache_spec")
    for leaf in (f"mlxserve.{name}" for name in leaves):
        assert internal_imports(leaf) == set(), leaf


def test_every_package_directory_is_a_regular_package() -> None:
    """find_packages() ships only directories with an __init__.py."""
    for path in PACKAGE.rglob("*.py"):
        if "csrc" in path.parts:
            continue
        assert (path.parent / "__init__.py").exists(), path.parent


# The CPU backend: mlxserve's CPU kernels and what runs them (the BLAS binding, the ops on
# the kernels, the fused layers and their installer), one wing installed on a model at load
# time.
CPU_BACKEND = ("mlxserve.cpu",)


def cpu_backend_imports(module: str) -> set[str]:
    return {
        i
        for i in internal_imports(module, type_only_too=True)
        if any(i == b or i.startswith(b + ".") for b in CPU_BACKEND)
    }


def test_cpu_backend_finder_sees_imports_of_it() -> None:
    # The loader installs the wing (a module of the package); the settings bind its BLAS.
    assert "mlxserve.cpu.install" in cpu_backend_imports("mlxserve.loader")
    assert cpu_backend_imports("mlxserve.settings") == {"mlxserve.cpu.blas"}
    assert cpu_backend_imports("mlxserve.models.contract") == set()


def test_models_import_no_cpu_backend() -> None:
    """A file in models/ is architecture only: it never asks which backend it runs on."""
    bad = {m: sorted(cpu_backend_imports(m)) for m in modules() if wing(m) == "models"}
    assert {m: v for m, v in bad.items() if v} == {}


# Who may read the environment: the settings' one place (mlxserve/settings.py), the engine
# config's defaults (config.py) and the command line. Elsewhere, only variables that are not
# mlxserve settings: the C toolchain's and the cache folder's (building the kernels), and
# the rank a distributed launcher (mlx.launch, mpirun) gives its processes.
ENVIRONMENT_READERS = ("mlxserve.config", "mlxserve.settings")
FOREIGN_VARIABLES = {
    "mlxserve.cpu.blas": {"CC", "XDG_CACHE_HOME"},
    "mlxserve.cpu.build": set(),  # _tool(env): CC / CXX, by name in a variable
    "mlxserve.worker.launch": {"MLX_RANK", "OMPI_COMM_WORLD_RANK", "MLX_HOSTFILE"},
}


def environment_uses(tree: ast.AST) -> list[ast.AST]:
    """Each ``os.environ`` / ``os.getenv`` / ``environ`` reference in ``tree``."""
    return [
        node
        for node in ast.walk(tree)
        if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"))
        or (isinstance(node, ast.Name) and node.id in ("environ", "getenv"))
    ]


def environment_names(tree: ast.AST) -> set[str]:
    """The variables ``tree`` reads by name (``environ.get("X")``, ``getenv("X")``, ``["X"]``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = ast.unparse(node.func)
            if node.func.attr == "getenv" or (node.func.attr == "get" and "environ" in func):
                out |= {a.value for a in node.args[:1] if isinstance(a, ast.Constant)}
        if isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value):
            if isinstance(node.slice, ast.Constant):
                out.add(node.slice.value)
    return out


def test_the_environment_is_read_only_by_the_config_and_cli_layer() -> None:
    readers = {m for m in modules() if environment_uses(tree_of(m))}
    allowed = {m for m in readers if m in ENVIRONMENT_READERS or wing(m) == "cli"}
    assert sorted(readers - allowed) == sorted(FOREIGN_VARIABLES)
    for module, variables in FOREIGN_VARIABLES.items():
        assert environment_names(tree_of(module)) <= variables, module


def test_the_environment_finders_see_every_way_of_reading_it() -> None:
    planted = ast.parse(
        "import os\nfrom os import environ\n"
        'a = os.environ.get("MLXSERVE_A", "x")\nb = os.getenv("B")\nc = os.environ["C"]\n'
        'd = environ.get("D")\n'
    )
    assert environment_names(planted) == {"MLXSERVE_A", "B", "C", "D"}
    assert environment_uses(ast.parse("import os\nx = dict(os.environ)\n"))
    assert not environment_uses(ast.parse("import os\nx = os.path.join('a', 'b')\n"))
