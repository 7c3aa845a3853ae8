"""Layers every architecture shares: RMSNorm and rotary position embeddings (RoPE), with
the RoPE scaling types a config may ask for."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxserve import ops
from mlxserve.models import compiled
from mlxserve.module_changes import Watched
from mlxserve.utils import uses_gpu

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "freq_factors")


def resolve_rope(
    rope_theta: float | None,
    rope_scaling: dict[str, Any] | None,
    rope_parameters: dict[str, Any] | None,
    default_theta: float,
) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the classic keys or transformers 5's ``rope_parameters``."""
    if rope_parameters:
        if rope_theta is None:
            rope_theta = rope_parameters.get("rope_theta")
        if rope_scaling is None:
            rope_scaling = rope_parameters
    if rope_scaling is not None and _rope_type(rope_scaling) == "default":
        rope_scaling = None
    return float(default_theta if rope_theta is None else rope_theta), rope_scaling


def _rope_type(scaling: dict[str, Any]) -> str:
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def _require_key(scaling: dict[str, Any], key: str) -> Any:
    if scaling.get(key) is None:
        raise ValueError(f"rope_scaling of type {_rope_type(scaling)!r} needs {key!r}: {scaling}")
    return scaling[key]


def llama3_inv_freq(
    head_dim: int, base: float, scaling: dict[str, Any]
) -> list[float]:  # (head_dim // 2,)
    """Llama 3.1 frequency scaling: slow down long wavelengths, keep short ones, blend between."""
    factor = float(_require_key(scaling, "factor"))
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor  # longer than this: fully scaled
    high_freq_wavelen = old_context / high_freq_factor  # shorter than this: unchanged
    out = []
    for i in range(0, head_dim, 2):
        inv_freq = 1.0 / base ** (i / head_dim)
        wavelen = 2 * math.pi / inv_freq
        if wavelen < high_freq_wavelen:
            out.append(inv_freq)
        elif wavelen > low_freq_wavelen:
            out.append(inv_freq / factor)
        else:
            smooth = (old_context / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out.append((1 - smooth) * inv_freq / factor + smooth * inv_freq)
    return out


class RMSNorm(Watched, nn.RMSNorm):
    """nn.RMSNorm; on the CPU one op of mlxserve's CPU primitives (ops.cpu_module), else
    compiled into 3 ops instead of MLX's 11 (models/compiled.py)."""

    def __call__(self, x: mx.array) -> mx.array:
        if uses_gpu():
            return mx.fast.rms_norm(x, self["weight"], self.eps)
        module = ops.cpu_module()
        if module is not None:
            return module.rms_norm(x, self["weight"], self.eps)
        return compiled.rms_norm(x, self["weight"], self.eps)


@dataclass
class _RopeTables:
    """A RotaryEmbedding's cos and sin for one positions array (a plain object: never
    part of the module's parameters)."""

    positions: mx.array | None = None
    cos: mx.array | None = None  # (num_tokens, 1, dims // 2)
    sin: mx.array | None = None
    inv_freqs: mx.array | None = None  # (dims // 2,): the same every step, made once


class RotaryEmbedding(Watched):
    """RoPE applied at an explicit position per token (flat token axis, any mix of requests).

    Scaling types: ``linear`` (positions / factor), ``llama3`` (per-frequency scaling),
    ``freq_factors`` (explicit per-frequency divisors, as GGUF's rope_freqs tensor) and
    ``dynamic`` (NTK; identical to plain RoPE within ``max_position_embeddings``, which is the
    context the model reports, so it is applied as plain RoPE).
    """

    def __init__(
        self,
        dims: int,
        base: float,
        traditional: bool = False,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self._base: float | None = base
        self._scale = 1.0
        self._freqs: mx.array | None = None
        rope_type = "default" if scaling is None else _rope_type(scaling)
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        if rope_type == "linear":
            self._scale = 1.0 / float(_require_key(scaling, "factor"))
        elif rope_type == "llama3":
            # mx.fast.rope takes periods (1 / inv_freq) when given explicit frequencies.
            inv_freq = llama3_inv_freq(dims, base, scaling)
            self._freqs = mx.array([1.0 / f for f in inv_freq], dtype=mx.float32)
            self._base = None
        elif rope_type == "freq_factors":
            # llama.cpp's rope_freqs (GGUF): frequency i is divided by freq_factors[i].
            factors = _require_key(scaling, "freq_factors")
            if len(factors) != dims // 2:
                raise ValueError(
                    f"rope_scaling freq_factors has {len(factors)} entries, expected {dims // 2}"
                )
            periods = [base ** (2 * i / dims) * float(f) for i, f in enumerate(factors)]
            self._freqs = mx.array(periods, dtype=mx.float32)
            self._base = None

        self._memo = _RopeTables()  # CPU: the last positions' cos and sin (see tables)

    def split_rotate(
        self,
        x: mx.array,  # (num_tokens, sum of heads[i] * head_dims[i]): e.g. q | k | v
        positions: mx.array,  # (num_tokens,) int32
        heads: Sequence[int],
        head_dims: Sequence[int],
        rotated: int,
    ) -> list[mx.array]:  # (num_tokens, heads[i], head_dims[i]) each
        """``x`` split into per-head arrays, the first ``rotated`` of them with RoPE: on the
        CPU one op of mlxserve's CPU primitives (a fused q|k|v projection's split, reshapes
        and rotations, with the step's cos and sin tables), else the same ops as calling
        this module on each."""
        module = None if uses_gpu() else ops.cpu_module()
        if module is not None:
            cos, sin = self.tables(positions, x.dtype)  # once per step (MLX's cos and sin)
            return module.rope_split(x, cos, sin, heads, head_dims, rotated, self.traditional)
        sizes = [h * d for h, d in zip(heads, head_dims, strict=True)]
        bounds = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
        parts = mx.split(x, bounds, axis=-1) if bounds else [x]
        num_tokens = x.shape[0]
        out = [p.reshape(num_tokens, h, d) for p, h, d in zip(parts, heads, head_dims, strict=True)]
        return [self(p, positions) if i < rotated else p for i, p in enumerate(out)]

    def tables(
        self, positions: mx.array, dtype: mx.Dtype
    ) -> tuple[mx.array, mx.array]:  # 2 x (num_tokens, 1, dims // 2)
        """cos and sin of every token's angles, made once per ``positions`` array.

        The same values mx.fast.rope's portable version computes (MLX's CPU backend runs
        that one: ~30 ops per call); the layers share this module, so a step computes
        them once instead of twice per layer.
        """
        memo = self._memo
        if memo.positions is positions and memo.cos is not None and memo.cos.dtype == dtype:
            return memo.cos, memo.sin
        if memo.inv_freqs is None:
            half = self.dims // 2
            if self._freqs is None:
                exponent = mx.arange(0, -half, -1, dtype=mx.float32)
                c = mx.array(math.log(self._base) / half, mx.float32)
                memo.inv_freqs = mx.exp(exponent * c)
            else:
                memo.inv_freqs = mx.reciprocal(self._freqs)
        at = positions.astype(mx.float32)  # (num_tokens,)
        if self._scale != 1.0:  # (times 1.0 changes no value: no op for it)
            at = at * mx.array(self._scale, mx.float32)
        theta = at[:, None, None] * memo.inv_freqs  # (num_tokens, 1, half)
        cos, sin = mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype)
        memo.positions, memo.cos, memo.sin = positions, cos, sin
        return cos, sin

    def _rotate(
        self,
        x: mx.array,  # (num_tokens, num_heads, head_dim)
        cos: mx.array,  # (num_tokens, 1, dims // 2)
        sin: mx.array,
    ) -> mx.array:  # (num_tokens, num_heads, head_dim)
        dims = self.dims
        if self.traditional:  # pairs (0, 1), (2, 3), ...
            x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        else:  # halves: (i, i + dims / 2)
            x1, x2 = x[..., : dims // 2], x[..., dims // 2 : dims]
        out1, out2 = compiled.rotate(x1, x2, cos, sin)
        if self.traditional:
            rotated = mx.stack([out1, out2], axis=-1).reshape(*x.shape[:-1], dims)
            parts = [rotated]
        else:
            parts = [out1, out2]
        if dims < x.shape[-1]:
            parts.append(x[..., dims:])
        return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]

    def __call__(
        self,
        x: mx.array,  # (num_tokens, num_heads, dims)
        positions: mx.array,  # (num_tokens,) int32
    ) -> mx.array:  # (num_tokens, num_heads, dims)
        if not uses_gpu():
            if ops.cpu_module() is not None:
                return self.split_rotate(x, positions, [x.shape[1]], [x.shape[2]], 1)[0]
            return self._rotate(x, *self.tables(positions, x.dtype))
        # Each token is its own "batch" row of length 1, so offset=positions rotates it
        # by its own position.
        y = mx.fast.rope(
            x[:, :, None, :],  # (num_tokens, num_heads, 1, dims)
            self.dims,
            traditional=self.traditional,
            base=self._base,
            scale=self._scale,
            offset=positions,
            freqs=self._freqs,
        )
        return y[:, :, 0, :]
