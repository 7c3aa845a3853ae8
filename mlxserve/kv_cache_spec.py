"""What each cache layer of a model needs, and how the engine lays those needs out.

A model says what each of its cache layers (one entry of mlx-lm's ``make_cache()``) needs
with a :class:`LayerCacheSpec`: full attention, a sliding window of W tokens, or a
recurrent state (linear attention, SSM). :func:`make_layout` turns the specs into a
:class:`KVCacheLayout`, the shape of vLLM v1's hybrid allocator, simplified:

* **KV cache groups.** Attention layers of one kind (full, or a window of W) form groups,
  each with its own block table per request. Groups hold the same number of layers, so a
  block id means the same bytes in every group, and all groups draw from one block pool.
  A windowed group releases the blocks that fall wholly out of its window.
* **K/V tensors.** Layer j of every group shares tensor j: a block id belongs to one group
  at a time, so the pool costs ``num_blocks x (one group's layers)``, not all layers::

      gpt-oss (sliding, full, sliding, full)    groups: S = (0, 2), F = (1, 3)
      tensor 0: layers 0 (S) and 1 (F)          block 5 in S's table: layer 0's K/V
      tensor 1: layers 2 (S) and 3 (F)          block 6 in F's table: layer 1's K/V

  Sharing needs every attention layer to have the same K/V shape; when they differ
  (Gemma 4's global layers have larger heads) all attention layers form one group, each
  with its own tensor, and windowed layers keep their blocks (``reason`` says so).
* **State slots.** Recurrent layers keep one fixed-size state per request in a slot pool,
  not in blocks.

Nothing here imports mlx: the scheduler's side (core) and the device's side (worker,
models) read the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
RECURRENT = "recurrent"
KINDS = (FULL_ATTENTION, SLIDING_WINDOW, RECURRENT)

# Bytes per element of the dtypes a recurrent state may be kept in.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
# An 8-bit K/V pool (dtype int8, --kv-cache-dtype int8) stores each (token, KV head) row as
# head_dim int8 values followed by their float32 scale: mlxserve/ops/kv_quant.py.
KV_SCALE_BYTES = 4


def kv_row_bytes(head_dim: int, dtype) -> int:
    """Bytes of one (token, KV head) row of a pool of ``dtype`` (anything with ``.size``;
    an int8 pool is 8-bit quantized and carries its scale)."""
    if str(dtype).rsplit(".", 1)[-1] == "int8":
        return head_dim + KV_SCALE_BYTES
    return head_dim * dtype.size


@dataclass(frozen=True)
class LayerCacheSpec:
    """What one cache layer needs.

    Attention (``full_attention``, ``sliding_window``): K/V of ``num_kv_heads`` heads of
    ``k_head_dim`` / ``v_head_dim`` per token; with a window, a query at position p attends
    to keys in (p - window, p]. ``recurrent``: per request, one array of each shape in
    ``state_shapes`` (dtype names in ``state_dtypes``), whatever the sequence length.
    """

    kind: str
    num_kv_heads: int = 0
    k_head_dim: int = 0
    v_head_dim: int = 0
    window: int | None = None
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        assert (self.window is not None) == (self.kind == SLIDING_WINDOW), self
        assert len(self.state_shapes) == len(self.state_dtypes), self

    @property
    def is_attention(self) -> bool:
        return self.kind != RECURRENT

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(num_kv_heads, k_head_dim, v_head_dim)."""
        return (self.num_kv_heads, self.k_head_dim, self.v_head_dim)

    def bytes_per_token(self, dtype) -> int:
        """K + V bytes one token takes in this layer's pool (rows as kv_row_bytes)."""
        return self.num_kv_heads * (
            kv_row_bytes(self.k_head_dim, dtype) + kv_row_bytes(self.v_head_dim, dtype)
        )

    def state_bytes(self) -> int:
        """Bytes of one request's state in this layer (0 for attention layers)."""
        total = 0
        for shape, dtype in zip(self.state_shapes, self.state_dtypes, strict=True):
            n = DTYPE_SIZES[dtype]
            for dim in shape:
                n *= dim
            total += n
        return total


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Attention layers sharing one block table per request.

    ``window`` is None for full attention; a windowed group may release blocks whose
    tokens are all more than ``window`` - 1 positions behind the next token computed.
    """

    kind: str
    window: int | None
    layers: tuple[int, ...]  # cache layer indices (make_cache() order)

    def blocks_needed(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds at once in this group,
        when at most ``chunk`` tokens are computed per step."""
        full = -(-num_tokens // block_size)
        if self.window is None:
            return full
        # Blocks kept for the window behind the chunk, plus the chunk's own.
        return min(full, -(-(self.window - 1 + chunk) // block_size) + 1)


@dataclass(frozen=True)
class KVCacheLayout:
    """Groups, K/V tensors and state layers of a model (see the module docstring)."""

    specs: tuple[LayerCacheSpec, ...]
    groups: tuple[KVCacheGroupSpec, ...]
    layer_groups: tuple[int, ...]  # per cache layer: its group, -1 for recurrent layers
    layer_tensors: tuple[int, ...]  # per cache layer: its K/V tensor, -1 for recurrent
    tensor_shapes: tuple[tuple[int, int, int], ...]  # (num_kv_heads, k_head_dim, v_head_dim)
    state_layers: tuple[int, ...]  # cache layer indices of the recurrent layers
    # Why windowed layers do not release blocks (None when they do, or there are none).
    reason: str | None = None

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def has_state(self) -> bool:
        return bool(self.state_layers)

    def bytes_per_block(self, block_size: int, dtype) -> int:
        """K + V bytes of one block id across the tensors."""
        return sum(
            block_size * h * (kv_row_bytes(k, dtype) + kv_row_bytes(v, dtype))
            for h, k, v in self.tensor_shapes
        )

    def state_bytes_per_slot(self) -> int:
        """Bytes of one state slot across the recurrent layers."""
        return sum(self.specs[i].state_bytes() for i in self.state_layers)

    def blocks_per_request(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds at once, all groups."""
        return sum(g.blocks_needed(num_tokens, block_size, chunk) for g in self.groups)

    def describe(self) -> str:
        """One line for the start-up log: groups, tensors, state layers."""
        parts = []
        for g in self.groups:
            what = "full attention" if g.window is None else f"window {g.window}"
            parts.append(f"{what} x{len(g.layers)}")
        text = f"{len(self.groups)} KV group(s) [{', '.join(parts)}] on "
        text += f"{len(self.tensor_shapes)} K/V tensor(s)"
        if not self.groups:
            text = "no attention layers (no KV blocks)"
        if self.state_layers:
            text += f"; {len(self.state_layers)} recurrent layer(s) in state slots"
        if self.reason:
            text += f"; {self.reason}"
        return text


def make_layout(specs: tuple[LayerCacheSpec, ...] | list[LayerCacheSpec]) -> KVCacheLayout:
    """Group the attention layers by kind and assign tensors (see the module docstring)."""
    specs = tuple(specs)
    attention = [i for i, s in enumerate(specs) if s.is_attention]
    state_layers = tuple(i for i, s in enumerate(specs) if not s.is_attention)
    by_kind: dict[tuple[str, int | None], list[int]] = {}
    for i in attention:
        by_kind.setdefault((specs[i].kind, specs[i].window), []).append(i)
    shapes = {specs[i].kv_shape for i in attention}
    reason = None
    if len(by_kind) > 1 and len(shapes) > 1:
        reason = "sliding-window blocks are kept (its layers' K/V shapes differ)"
    if len(by_kind) <= 1 or reason:
        # One group; windowed only if every layer is, releasing behind the widest window.
        windows = [specs[i].window for i in attention]
        window = None if None in windows or not windows else max(windows)
        kind = FULL_ATTENTION if window is None else SLIDING_WINDOW
        groups = (KVCacheGroupSpec(kind, window, tuple(attention)),) if attention else ()
        chunks = [list(attention)] if attention else []
    else:
        # Groups of equal size (the smallest kind's layer count); a kind whose count is not
        # a multiple leaves its last group short (those tensor slots idle in that group).
        size = min(len(layers) for layers in by_kind.values())
        groups_list, chunks = [], []
        for (kind, window), layers in by_kind.items():
            for start in range(0, len(layers), size):
                chunk = layers[start : start + size]
                groups_list.append(KVCacheGroupSpec(kind, window, tuple(chunk)))
                chunks.append(chunk)
        groups = tuple(groups_list)
    layer_groups = [-1] * len(specs)
    layer_tensors = [-1] * len(specs)
    num_tensors = max((len(c) for c in chunks), default=0)
    tensor_shapes: list[tuple[int, int, int] | None] = [None] * num_tensors
    for g, chunk in enumerate(chunks):
        for t, i in enumerate(chunk):
            layer_groups[i], layer_tensors[i] = g, t
            assert tensor_shapes[t] in (None, specs[i].kv_shape), (tensor_shapes[t], specs[i])
            tensor_shapes[t] = specs[i].kv_shape
    return KVCacheLayout(
        specs=specs,
        groups=groups,
        layer_groups=tuple(layer_groups),
        layer_tensors=tuple(layer_tensors),
        tensor_shapes=tuple(s for s in tensor_shapes if s is not None),
        state_layers=state_layers,
        reason=reason,
    )


def uniform_layout(num_layers: int, num_kv_heads: int, head_dim: int) -> KVCacheLayout:
    """The layout of a model whose layers are all full attention of one shape."""
    spec = LayerCacheSpec(FULL_ATTENTION, num_kv_heads, head_dim, head_dim)
    return make_layout([spec] * num_layers)
