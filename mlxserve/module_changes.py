"""Modules that count their changes, so that what is kept from them between steps (the CPU
decoder stack's weights and settings, mlxserve/cpu/stack.py) knows when to be made again.

Every way Python changes a module's contents goes through the methods below: attributes
and items set or deleted (``nn.Module.update``, ``load_weights`` and ``update_modules``
assign items; attribute assignment assigns items for arrays and modules). An array changed
in place (``w[...] = v``) is not a change of the module, and model code never does that.

A leaf module: nothing here imports mlxserve.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

__all__ = ["Watched", "count"]

_count = 0


def count() -> int:
    """How many times a :class:`Watched` module has changed in this process."""
    return _count


def _changed() -> None:
    global _count
    _count += 1


class Watched(nn.Module):
    """An nn.Module whose changes are counted (:func:`count`); a base before MLX's layer
    classes, e.g. ``class RMSNorm(Watched, nn.RMSNorm)``."""

    def __setattr__(self, key: str, value: Any) -> None:
        _changed()
        super().__setattr__(key, value)

    def __delattr__(self, key: str) -> None:
        _changed()
        super().__delattr__(key)

    def __setitem__(self, key: str, value: Any) -> None:
        _changed()
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        _changed()
        super().__delitem__(key)

    def pop(self, *args: Any) -> Any:
        _changed()
        return super().pop(*args)

    def popitem(self) -> Any:
        _changed()
        return super().popitem()

    def setdefault(self, *args: Any) -> Any:
        _changed()
        return super().setdefault(*args)

    def clear(self) -> None:
        _changed()
        super().clear()

    def __ior__(self, other: Any) -> Watched:
        _changed()
        return super().__ior__(other)
