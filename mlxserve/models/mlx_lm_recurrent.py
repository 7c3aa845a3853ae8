"""Recurrent layers (gated delta nets, SSMs) of mlx-lm models on the paged engine.

The adapter's flat layout feeds a step's tokens as rows of length 1, which is all an
attention layer needs. A recurrent layer needs each request's tokens in order, starting
from that request's state. So the module that takes the layer's cache (the "mixer":
``linear_attn`` in Qwen3-Next / Qwen3.5, ``mixer`` in Mamba) is hooked: given a
:class:`PagedStateCache`, it regroups the flat rows per request and calls mlx-lm's own
mixer on them, with a real mlx-lm ``ArraysCache`` holding that request's state::

    flat rows:  | d0 | d1 | d2 | p0 p0 p0 p0 p0 | p1 p1 |
    calls:      (B=3, L=1) decodes batched      (1, 5)          (1, 2)
                states gathered from the pool's read slots, written back to write slots

Each call is unpadded and unmasked, the exact code path of mlx-lm's own generation. A
prefill chunk that takes snapshots (prefix caching) is cut at those offsets, and the
state after each piece is written to its snapshot slot too.
"""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxserve.exceptions import UnsupportedModelError
from mlxserve.kv_cache_spec import RECURRENT, LayerCacheSpec


class RecurrentStateError(UnsupportedModelError):
    """A recurrent layer that does not fit the regrouping (see the module docstring)."""


MLX_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


def state_spec(cache: Any, where: str) -> LayerCacheSpec:
    """The spec of an mlx-lm ArraysCache after one forward pass of batch size 1 or more."""
    shapes, dtypes = [], []
    for j, array in enumerate(cache.cache):
        if array is None:
            raise RecurrentStateError(f"{where}: state array {j} is never written")
        if array.dtype not in MLX_DTYPE_NAMES:
            raise RecurrentStateError(f"{where}: state array {j} has dtype {array.dtype}")
        shapes.append(tuple(array.shape[1:]))
        dtypes.append(MLX_DTYPE_NAMES[array.dtype])
    return LayerCacheSpec(RECURRENT, state_shapes=tuple(shapes), state_dtypes=tuple(dtypes))


class PagedStateCache:
    """Stands in for one mlx-lm ArraysCache during a paged step; only the hooked mixer
    reads it (anything else touching the state is refused)."""

    def __init__(self, step: Any, index: int, state_index: int, where: str) -> None:
        self._step = step  # the adapter's _Step: md, state_md, kv_cache
        self.index = index
        self.state_index = state_index
        self._where = where
        self.used = False

    def make_mask(self, n: int, *args, **kwargs) -> None:
        """No padding, so no mask: each call gets one request's tokens (or one each)."""
        return None

    def __getitem__(self, i: int) -> None:
        raise RecurrentStateError(f"{self._where}: state read outside its hooked mixer")

    __setitem__ = __getitem__

    def run(self, call, x: mx.array) -> mx.array:
        """``call(x, arrays_cache) -> y`` over the step's requests, states from the pool.

        x: (num_tokens, 1, hidden) flat rows; returns (num_tokens, 1, out) in row order.
        """
        from mlx_lm.models.cache import ArraysCache

        step = self._step
        md, st = step.md, step.state_md
        if st is None:
            raise RecurrentStateError(
                f"{self._where}: a recurrent layer needs per-request state slots "
                "(StateMetadata): run the model through the engine"
            )
        if self.used:
            raise RecurrentStateError(f"{self._where}: its mixer ran twice in one step")
        self.used = True
        pools = step.kv_cache.states[self.state_index]
        # Every request's starting state, read and evaluated by the adapter before the
        # step was built (see MlxLmModel.__call__): the write below then updates the pool
        # in place instead of copying it.
        assert step.state_starts is not None
        starts = step.state_starts[self.state_index]  # (num_reqs, ...) each

        def gather(first: int, end: int) -> ArraysCache:
            cache = ArraysCache(len(pools))
            for j, start in enumerate(starts):
                cache[j] = start[first:end]  # (rows, ...)
            return cache

        outs: list[mx.array] = []
        finals: list[list[mx.array]] = [[] for _ in pools]  # per array, in batch order
        snaps: dict[tuple[int, int], list[mx.array]] = {}  # (request, offset) -> arrays
        cuts: dict[int, set[int]] = {}
        for i, offset, _ in st.snapshots:
            cuts.setdefault(i, set()).add(offset)
        nd = md.num_decodes
        if nd:
            cache = gather(0, nd)
            outs.append(call(x[:nd], cache))  # (nd, 1, out)
            for j in range(len(pools)):
                finals[j].append(cache[j])
            for i in range(nd):
                if i in cuts:  # a decode's snapshot is its state after the token
                    snaps[(i, 1)] = [cache[j][i : i + 1] for j in range(len(pools))]
        row = sum(md.query_lens[:nd])
        for i in range(nd, md.num_reqs):
            length = md.query_lens[i]
            cache = gather(i, i + 1)
            done = 0
            for cut in [*sorted(c for c in cuts.get(i, ()) if c < length), length]:
                piece = x[row + done : row + cut, 0][None]  # (1, cut - done, hidden)
                outs.append(call(piece, cache)[0][:, None])  # (cut - done, 1, out)
                if cut in cuts.get(i, ()):
                    snaps[(i, cut)] = [cache[j] for j in range(len(pools))]
                done = cut
            for j in range(len(pools)):
                finals[j].append(cache[j])
            row += length
        if row < x.shape[0]:  # bucketing padding: rows nobody reads
            out_dim = outs[-1].shape[-1]
            outs.append(mx.zeros((x.shape[0] - row, 1, out_dim), dtype=outs[-1].dtype))
        for j, pool in enumerate(pools):
            written = finals[j] + [snaps[(i, off)][j] for i, off, _ in st.snapshots]
            values = mx.concatenate(written).astype(pool.dtype)  # (num_written, ...)
            updated = pool.reshape(pool.shape)
            updated[st.write_order] = values
            pools[j] = updated
        return mx.concatenate(outs) if len(outs) > 1 else outs[0]


def _takes_cache(module: nn.Module) -> bool:
    try:
        params = inspect.signature(type(module).__call__).parameters
    except (TypeError, ValueError):
        return False
    return "cache" in params


def hook_mixers(layers: list[nn.Module], model_type: str) -> None:
    """Hook every candidate mixer: the deepest modules under the model's layers that take
    ``(x, mask, cache)`` or ``(x, cache)`` (their class is swapped for a regrouping
    subclass).

    Cache layers need not be model layers one to one (Nemotron-H's MLP layers have no
    cache), so every candidate is hooked; a hooked module given an attention cache runs
    unchanged, and a recurrent cache no hooked module ran is refused after the forward pass.
    """
    hooked = 0
    for layer in layers:
        found = [(p, m) for p, m in layer.named_modules() if p and _takes_cache(m)]
        for path, module in found:
            if any(q.startswith(path + ".") for q, _ in found):
                continue  # not the deepest
            regrouping = _regrouping_class(type(module))
            if regrouping is not None:
                module.__class__ = regrouping
                hooked += 1
    if not hooked:
        raise RecurrentStateError(
            f"{model_type}: no module under its layers takes (x, [mask,] cache): nowhere to "
            "run its recurrent state"
        )


def _regrouping_class(base: type) -> type | None:
    """The regrouping subclass of a mixer class (None: its call is not (x, [mask,] cache))."""
    if getattr(base, "_mlxserve_regroups", False):
        return base
    signature = inspect.signature(base.__call__)
    names = list(signature.parameters)
    takes_mask = names[2:4] == ["mask", "cache"]
    if not (takes_mask or names[2:3] == ["cache"]):
        return None
    first = names[1]

    def __call__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        cache = bound.arguments.get("cache")
        if not isinstance(cache, PagedStateCache):
            return base.__call__(self, *args, **kwargs)
        if bound.arguments.get("mask") is not None:
            raise RecurrentStateError(f"{cache._where}: the model passed its mixer a mask")

        def call(x: mx.array, arrays_cache) -> mx.array:
            mask = {"mask": None} if takes_mask else {}
            return base.__call__(self, **{first: x, "cache": arrays_cache}, **mask)

        return cache.run(call, bound.arguments[first])

    return type(base.__name__, (base,), {"__call__": __call__, "_mlxserve_regroups": True})
