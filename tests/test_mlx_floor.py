"""The MLX range pyproject.toml declares: one range on every platform, a floor no older than
the first release mlxserve is correct on, and the installed MLX inside it."""

from __future__ import annotations

import re

import mlx.core as mx

from tests.paths import ROOT

# Hand-derived from MLX's history (ml-explore/mlx): 0.32.0 is the first release that loads
# Q4_1 GGUF correctly (#3664; the embedded model is Q4_1) and names custom kernels by their
# input types and bindings (#3662); 0.32.3 is the first whose bindings (nanobind 3) can pass
# an mx.array to mlxserve's CPU kernels (0.32.0-0.32.2: "incompatible function arguments").
FIRST_CORRECT = (0, 32, 3)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def mlx_ranges() -> list[tuple[str, str]]:
    text = (ROOT / "pyproject.toml").read_text()
    deps = text.split("dependencies = [", 1)[1].split("]\n", 1)[0]
    return re.findall(r'"mlx(?:\[cpu\])?>=([0-9.]+),<([0-9.]+);', deps)


def test_one_mlx_range_with_a_correct_floor() -> None:
    ranges = mlx_ranges()
    assert len(ranges) == 2 and len(set(ranges)) == 1, ranges  # darwin and the CPU build
    floor, ceiling = ranges[0]
    assert _version(floor) >= FIRST_CORRECT
    assert _version(floor) < _version(ceiling)


def test_installed_mlx_is_in_the_declared_range() -> None:
    floor, ceiling = mlx_ranges()[0]
    installed = _version(re.match(r"[0-9.]+", mx.__version__).group().strip("."))
    assert _version(floor) <= installed < _version(ceiling), mx.__version__
