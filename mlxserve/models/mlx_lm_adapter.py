"""Run mlx-lm's model classes on mlxserve's paged KV pool (attention-only architectures).

The flat layout
---------------
A step's T tokens (any mix of requests, decodes and prefill chunks) go into the mlx-lm model
as a batch of T rows of length 1. Every per-token op (embeddings, norms, MLPs, MoE switch
layers, RoPE) then runs unchanged and unpadded: ``cache.offset`` is the (T,) array of the
tokens' positions, which ``mx.fast.rope`` takes as a per-row offset. Attention is the only
op that mixes tokens, and it is the only thing intercepted.

The interception surface (all of it)
------------------------------------
1. **The cache objects.** The model is called with one :class:`PagedLayerCache` per entry of
   its ``make_cache()``: ``offset`` is the positions array, ``update_and_fetch(k, v)`` records
   this step's K/V (T, kv_heads, 1, head_dim) and returns them unchanged, ``make_mask``
   returns None (a row of length 1 needs no mask).
2. **``scaled_dot_product_attention``**, the name mlx-lm's model modules import from
   ``mlx_lm.models.base``, is rebound in those modules' namespaces to :func:`paged_sdpa`:
   with a PagedLayerCache it writes the recorded K/V into the block pool (``ops.write_kv``)
   and runs ``ops.paged_attention`` (with the layer's sliding window and ``sinks=``); with any
   other cache it calls mlx-lm's own function, so mlx-lm keeps working in the same process.
   Layers that attend to another layer's K/V (Gemma 4's KV sharing: ``cache=None``, keys
   returned by an earlier layer's ``update_and_fetch``) read that layer's pool.

3. **Recurrent mixers.** In a model with ``ArraysCache`` layers (gated delta nets, SSMs,
   short convolutions), the deepest modules taking ``(x, mask, cache)`` are hooked: given
   a state cache they regroup the flat rows per request and run on states from the pool's
   slots (mlxserve/models/mlx_lm_recurrent.py); given an attention cache they run as is.

With KV cache groups (mlxserve/kv_cache_spec.py), each layer reads its group's block tables
(``group_metadata``, one AttentionMetadata per group) and its K/V tensor of the layout;
without them every attention layer uses ``attn_metadata`` and a pool of its own.

Whatever falls outside this surface is refused, never silently wrong: a layer that takes its
K/V from ``update_and_fetch`` but computes attention by hand (soft-capping, MLA latent
scores), a mask the model built itself, or keys changed between ``update_and_fetch`` and the
attention call. These checks run while the graph is built, so ``build`` runs one paged
forward pass (not evaluated) and refuses such a model at load time.

Cache kinds (one :class:`LayerCacheSpec` per ``make_cache()`` entry): ``KVCache`` is full
attention, ``RotatingKVCache(max_size=W, keep=0)`` a sliding window of W tokens,
``ArraysCache`` a recurrent state. Chunked attention, cache lists and ``keep`` > 0 are not
supported yet and raise :class:`UnsupportedModelError` naming the model_type.
"""

from __future__ import annotations

import importlib
import types
from contextvars import ContextVar
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlxserve import ops
from mlxserve.exceptions import UnsupportedModelError
from mlxserve.kv_cache_spec import KVCacheLayout, LayerCacheSpec, make_layout
from mlxserve.models.base import KVCache
from mlxserve.models.mlx_lm_recurrent import PagedStateCache, hook_mixers
from mlxserve.ops import AttentionMetadata, StateMetadata

__all__ = ["LayerCacheSpec", "MlxLmModel", "PagedLayerCache", "UnsupportedModelError"]

# mlx-lm releases the adapter is tested with: [min, max). The surface above leans on mlx-lm's
# internals (cache protocol, the sdpa name), so another release must be tested first.
TESTED_MLX_LM = ((0, 32, 2), (0, 33, 0))
MLX_LM_PIN = "mlx-lm>=0.32.2,<0.33"


# ---- step context --------------------------------------------------------------------------
@dataclass
class _Step:
    """One paged forward pass: what the cache views and the attention calls share."""

    model_type: str  # for error messages
    positions: mx.array  # (num_tokens,) int32
    md: AttentionMetadata  # the step's layout (query lengths, decodes), as every group's
    group_mds: tuple[AttentionMetadata, ...]  # one per KV cache group (block tables)
    kv_cache: KVCache
    logits_indices: mx.array | None
    kv_cast_after_fetch: bool  # the layers cast K/V (dtype only) after update_and_fetch
    owners: dict[int, PagedLayerCache]  # id(keys returned by update_and_fetch) -> view
    state_md: StateMetadata | None = None
    # The last num_hidden_rows selected rows are wanted as hidden states (embeddings): the
    # hooked decoder stack keeps them here and hands only the others to the LM head.
    num_hidden_rows: int = 0
    hidden: mx.array | None = None  # (num_hidden_rows, hidden)
    # Per recurrent layer, every request's starting state (read from the pools up front).
    state_starts: list[list[mx.array]] | None = None


@dataclass
class _Probe:
    """A forward through mlx-lm's own caches: counts attention calls without a cache."""

    num_cacheless: int = 0


_STEP: ContextVar[_Step | _Probe | None] = ContextVar("mlxserve_paged_step", default=None)


class PagedLayerCache:
    """Stands in for one mlx-lm cache object during a paged step (see the module docstring)."""

    def __init__(
        self, step: _Step, index: int, spec: LayerCacheSpec, group: int, tensor: int
    ) -> None:
        self._step = step
        self.index = index
        self.spec = spec
        self.group = group  # whose block tables (step.group_mds[group]) this layer reads
        self.tensor = tensor  # which K/V pool of step.kv_cache holds its K/V
        self.keys: mx.array | None = None  # this step's K/V, as update_and_fetch returned them
        self.values: mx.array | None = None
        self.attended = False

    @property
    def offset(self) -> mx.array:  # (num_tokens,): each row's position
        return self._step.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Record (num_tokens, kv_heads, 1, head_dim) K/V; written to the pool at attention."""
        if self.keys is not None:
            raise UnsupportedModelError(f"{self._where}: updated twice in one step")
        self.keys, self.values = keys, values
        self._step.owners[id(keys)] = self
        return keys, values

    def make_mask(self, n: int, *args, window_size: int | None = None, **kwargs) -> None:
        """No mask: every row is one token, and its context is given by the metadata.

        A window the model asks for must be the one its cache keeps (what the ops apply).
        """
        if window_size is not None and window_size != self.spec.window:
            raise UnsupportedModelError(
                f"{self._where}: the model masks a window of {window_size} tokens but its "
                f"cache keeps {self.spec.window}"
            )
        return None

    def attend(
        self,
        queries: mx.array,  # (num_tokens, num_heads, 1, k_head_dim)
        keys: mx.array,
        values: mx.array,
        scale: float,
        mask: object,
        sinks: mx.array | None,
    ) -> mx.array:  # (num_tokens, num_heads, 1, v_head_dim)
        """This layer's paged attention (its own K/V, or another layer's when shared)."""
        self._check_call(keys, values, mask)
        step, i = self._step, self.tensor
        pools = step.kv_cache
        md = step.group_mds[self.group]
        q = queries[:, :, 0, :]  # (num_tokens, num_heads, k_head_dim)
        k, v = keys[:, :, 0, :], values[:, :, 0, :]  # (num_tokens, kv_heads, k/v_head_dim)
        args = (md, scale, self.spec.window, sinks)
        if not self.attended:  # else a KV-shared layer: this step's K/V are in the pool
            pools.keys[i], pools.values[i] = ops.write_kv(
                pools.keys[i], pools.values[i], k, v, md.slot_mapping
            )
        out = ops.paged_attention(q, pools.keys[i], pools.values[i], *args)
        self.attended = True
        return out[:, :, None, :]

    def _check_call(self, keys: mx.array, values: mx.array, mask: object) -> None:
        if self._step.kv_cast_after_fetch:  # a known dtype cast only: shapes must agree
            same = keys.shape == self.keys.shape and values.shape == self.values.shape
        else:
            same = keys is self.keys and values is self.values
        if not same:
            raise UnsupportedModelError(
                f"{self._where}: the attention call got keys/values other than the ones "
                "update_and_fetch returned (the layer changes them in between)"
            )
        if mask is not None and not isinstance(mask, str):
            raise UnsupportedModelError(
                f"{self._where}: the layer passes its own attention mask (scores computed "
                "outside scaled_dot_product_attention)"
            )

    @property
    def _where(self) -> str:
        return f"{self._step.model_type}: cache layer {self.index}"


def paged_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    """Stands for mlx_lm.models.base.scaled_dot_product_attention in mlx-lm's modules."""
    if isinstance(cache, PagedLayerCache):
        return cache.attend(queries, keys, values, scale, mask, sinks)
    state = _STEP.get()
    if isinstance(state, _Step):
        owner = state.owners.get(id(keys))
        if owner is None or not owner.attended:
            raise UnsupportedModelError(
                f"{state.model_type}: an attention call without a paged cache, on keys no "
                "earlier layer cached"
            )
        return owner.attend(queries, owner.keys, owner.values, scale, mask, sinks)
    if isinstance(state, _Probe) and cache is None:
        state.num_cacheless += 1
    return _mlx_lm_sdpa()(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _mlx_lm_sdpa():
    from mlx_lm.models import base

    return base.scaled_dot_product_attention


def install(module: types.ModuleType) -> None:
    """Rebind ``scaled_dot_product_attention`` to paged_sdpa in ``module`` and in every loaded
    mlx-lm model module that imported mlx-lm's (model files import layers from each other)."""
    import sys

    original = _mlx_lm_sdpa()
    for name, mod in list(sys.modules.items()):
        if name == "mlx_lm.models.base":  # the original stays where it is defined
            continue
        if mod is module or name.startswith("mlx_lm.models."):
            if getattr(mod, "scaled_dot_product_attention", None) is original:
                mod.scaled_dot_product_attention = paged_sdpa


# ---- the adapted model -----------------------------------------------------------------------
class MlxLmModel(nn.Module):
    """An mlx-lm model with mlxserve's interface:
    ``model(input_ids, positions, attn_metadata, kv_cache, logits_indices) -> logits``."""

    def __init__(
        self,
        model: nn.Module,
        model_type: str,
        specs: list[LayerCacheSpec],
        vocab_size: int,
        max_position_embeddings: int | None,
        kv_cast_after_fetch: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.model_type = model_type
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self._cache_specs = tuple(specs)
        self._layout = make_layout(self._cache_specs)
        self._kv_cast_after_fetch = kv_cast_after_fetch
        self._selects_rows = _hook_row_selection(model)
        if self._layout.state_layers:
            hook_mixers(list(model.layers), model_type)
        # Without KV cache groups: the pool index of each attention layer.
        attention = [i for i, spec in enumerate(specs) if spec.is_attention]
        self._own_pool = {layer: n for n, layer in enumerate(attention)}

    @property
    def cache_specs(self) -> tuple[LayerCacheSpec, ...]:
        """One spec per cache layer, in ``make_cache()`` order."""
        return self._cache_specs

    @property
    def kv_cache_layout(self) -> KVCacheLayout:
        """KV cache groups, K/V tensors and state layers (mlxserve/kv_cache_spec.py)."""
        return self._layout

    @property
    def kv_layer_shapes(self) -> list[tuple[int, int, int]]:
        """(num_kv_heads, k_head_dim, v_head_dim) of each attention layer's own pool."""
        return [s.kv_shape for s in self._cache_specs if s.is_attention]

    @property
    def num_layers(self) -> int:
        return len(self._cache_specs)

    def __call__(
        self,
        input_ids: mx.array,  # (num_tokens,) int32
        positions: mx.array,  # (num_tokens,) int32
        attn_metadata: AttentionMetadata,
        kv_cache: KVCache,
        logits_indices: mx.array | None = None,  # (num_rows,) int32
        *,
        group_metadata: tuple[AttentionMetadata, ...] | None = None,
        state_metadata: StateMetadata | None = None,
        num_hidden_rows: int = 0,
    ) -> mx.array | tuple[mx.array, mx.array]:  # (num_rows or num_tokens, vocab_size)
        """One paged step: the logits of the selected rows. With ``group_metadata`` (one
        per KV cache group of the layout) the pools are the layout's tensors; without,
        ``attn_metadata`` serves every attention layer, each with its own pool
        (``KVCache.allocate_for``). ``state_metadata`` places the recurrent layers'
        states. With ``num_hidden_rows``, the last that many selected rows come back as
        final hidden states instead: ``(logits, hidden)`` (embeddings)."""
        if num_hidden_rows and not self._selects_rows:
            raise UnsupportedModelError(
                f"{self.model_type}: embeddings need the decoder stack's hidden states, and "
                "the adapter found no decoder stack module to take them from"
            )
        layout = self._layout
        mds = group_metadata if group_metadata is not None else (attn_metadata,)
        step = _Step(
            self.model_type,
            positions,
            attn_metadata,
            tuple(mds),
            kv_cache,
            logits_indices,
            self._kv_cast_after_fetch,
            {},
            state_md=state_metadata,
            num_hidden_rows=num_hidden_rows,
        )
        views: list[PagedLayerCache | PagedStateCache] = []
        for i, spec in enumerate(self._cache_specs):
            where = f"{self.model_type}: cache layer {i}"
            if not spec.is_attention:
                views.append(PagedStateCache(step, i, layout.state_layers.index(i), where))
            elif group_metadata is not None:
                views.append(
                    PagedLayerCache(step, i, spec, layout.layer_groups[i], layout.layer_tensors[i])
                )
            else:
                views.append(PagedLayerCache(step, i, spec, 0, self._own_pool[i]))
        if state_metadata is not None and kv_cache.states:
            # Every request's starting state, read (evaluated) before anything is built: a
            # read of a pool still pending when MLX runs this step's write to it keeps the
            # write from updating the pool in place, and it copies the whole pool (every
            # slot) instead. One evaluation for all layers: one wait per step, not per layer.
            step.state_starts = [
                [pool[state_metadata.read_slots] for pool in pools] for pools in kv_cache.states
            ]
            mx.eval(step.state_starts)
        token = _STEP.set(step)
        try:
            logits = self.model(input_ids[:, None], cache=views)  # (rows, 1, vocab)
        finally:
            _STEP.reset(token)
        for view in views:
            if isinstance(view, PagedStateCache):
                if not view.used:
                    raise UnsupportedModelError(
                        f"{self.model_type}: recurrent cache layer {view.index} was not run "
                        "by a hooked mixer"
                    )
            elif not view.attended:
                raise UnsupportedModelError(
                    f"{self.model_type}: cache layer {view.index} "
                    + (
                        "was not used by the forward pass"
                        if view.keys is None
                        else "computes attention outside scaled_dot_product_attention"
                    )
                )
        logits = logits[:, 0, :]  # (rows, vocab)
        if logits_indices is not None:
            if not self._selects_rows:
                return logits[logits_indices]
            if logits.shape[0] != logits_indices.shape[0] - num_hidden_rows:
                raise UnsupportedModelError(
                    f"{self.model_type}: the LM head got {logits.shape[0]} rows, not the "
                    f"{logits_indices.shape[0] - num_hidden_rows} selected (its decoder "
                    "stack is not the module the adapter hooked)"
                )
        if num_hidden_rows:
            assert step.hidden is not None, "the hooked decoder stack keeps the hidden rows"
            return logits, step.hidden[:, 0, :]
        return logits


DECODER_NAMES = ("model", "transformer", "language_model", "backbone")


def _hook_row_selection(model: nn.Module) -> bool:
    """Keep only the rows whose logits are wanted before the LM head.

    The hidden states come out of the decoder stack (``model.model`` in most mlx-lm files,
    ``model.transformer`` in some); its class is swapped for a subclass that indexes the
    rows the step asks for, so the outer model's head (tied or not, soft-capped or scaled)
    runs on those rows only. ``MlxLmModel`` checks the row count it gets back.
    """
    children = model.children()
    inner = next(
        (children[name] for name in DECODER_NAMES if isinstance(children.get(name), nn.Module)),
        None,
    )
    if inner is None:
        return False
    base = type(inner)
    if getattr(base, "_mlxserve_selects_rows", False):  # hooked by an earlier adapter
        return True

    def __call__(self, *args, **kwargs):
        h = base.__call__(self, *args, **kwargs)  # (num_tokens, 1, hidden)
        state = _STEP.get()
        if isinstance(state, _Step) and state.logits_indices is not None:
            h = h[state.logits_indices]
            if state.num_hidden_rows:  # (rows, 1, hidden): the LM head never sees these
                n = h.shape[0] - state.num_hidden_rows
                h, state.hidden = h[:n], h[n:]
        return h

    inner.__class__ = type(
        base.__name__, (base,), {"__call__": __call__, "_mlxserve_selects_rows": True}
    )
    return True


# ---- building -------------------------------------------------------------------------------
def require_mlx_lm() -> types.ModuleType:
    """mlx_lm, if installed in a tested version; else an error that says what to install."""
    try:
        import mlx_lm
    except ImportError:
        raise UnsupportedModelError(
            f"this architecture runs through mlx-lm, which is not installed: pip install "
            f"'{MLX_LM_PIN}' (or, in the mlxserve clone, pip install -e '.[mlx-lm]')"
        ) from None
    version = tuple(int(x) for x in mlx_lm.__version__.split(".")[:3] if x.isdigit())
    low, high = TESTED_MLX_LM
    if not low <= version < high:
        raise UnsupportedModelError(
            f"mlx-lm {mlx_lm.__version__} is not a version mlxserve's adapter is tested with "
            f"({MLX_LM_PIN}); install one: pip install '{MLX_LM_PIN}'"
        )
    return mlx_lm


def mlx_lm_classes(config: dict) -> tuple[type[nn.Module], type, types.ModuleType]:
    """(Model, ModelArgs, module) mlx-lm picks for this config (its own remapping)."""
    require_mlx_lm()
    from mlx_lm.utils import _get_classes  # version-pinned above

    model_cls, args_cls = _get_classes(config)
    return model_cls, args_cls, importlib.import_module(model_cls.__module__)


def run_paged_layer(
    layer: nn.Module,
    x: mx.array,  # (num_tokens, hidden)
    positions: mx.array,  # (num_tokens,) int32
    md: AttentionMetadata,
    kv_cache: KVCache,
    spec: LayerCacheSpec,
    model_type: str,
) -> mx.array:  # (num_tokens, hidden)
    """One mlx-lm decoder layer (``layer(x, mask, cache)``) over flat rows, its attention
    on K/V tensor 0 of ``kv_cache`` (an MTP layer's block: models/mtp.py)."""
    step = _Step(
        model_type,
        positions,
        md,
        group_mds=(md,),
        kv_cache=kv_cache,
        logits_indices=None,
        kv_cast_after_fetch=False,
        owners={},
    )
    view = PagedLayerCache(step, 0, spec, 0, 0)
    token = _STEP.set(step)
    try:
        out = layer(x[:, None, :], None, view)  # (num_tokens, 1, hidden)
    finally:
        _STEP.reset(token)
    if not view.attended:
        raise UnsupportedModelError(f"{model_type}: the MTP block did not attend")
    return out[:, 0, :]
