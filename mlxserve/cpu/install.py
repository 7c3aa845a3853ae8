"""Install the CPU backend on a loaded model: the model files never ask which backend runs.

The loader calls :func:`install` once a quantized model is built on MLX's CPU with the
kernels available. It

* routes the model's supported quantized layers through the kernels (kernels.use_kernels:
  each becomes a CpuQuantizedLinear / CpuQuantizedEmbedding, the same parameters), and
* binds the fused forwards (:func:`bind_forwards`) onto the llama-family decoder:

      DecoderLayer     one op (layer.decoder_layer), else its halves one op each
                       (attention_input, output_mlp) around ops.write_kv and
                       ops.paged_attention, else the architecture's own forward
      DecoderStack     a quantized embedding's lookup in one op (layer.embed), and
                       ``run_layers``: every layer in one op (stack.decoder_stack), else
                       layer by layer
      PipelineStage    ``run_layers``: this rank's layers in one op, else layer by layer

  Each instance's class is swapped for a subclass of its own class (as mlxserve's mlx-lm
  adapter hooks a decoder): parameters, names and checkpoints are unchanged, and each
  fused forward still decides per call, falling back to the class's own forward where it
  does not apply (projections not fused yet, another backend or the fallback forced for
  this step, 16-bit pools, ...).

The model runner binds again after fusing the projections and after tensor- or
pipeline-parallel splitting, so a pipeline stage, made from the loaded model later, runs
its layers in one op too (binding twice changes nothing). A tensor-parallel shard's
linear layers are wrappers, not CpuQuantizedLinear: layer.linear_args refuses them, so
those layers keep the separate ops; that check is where shards would join the fused ops.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import mlx.nn as nn

from mlxserve.cpu import kernels, stack
from mlxserve.cpu import layer as cpu_layer
from mlxserve.models import llama
from mlxserve.models.base import KVCache, select_rows
from mlxserve.models.pipeline_parallel import PipelineStage
from mlxserve.ops import AttentionMetadata

__all__ = ["bind_forwards", "install"]


class CpuDecoderLayer:
    """A llama.DecoderLayer's forward on the fused CPU ops where they apply."""

    def __call__(
        self, x: mx.array, positions: mx.array, md: AttentionMetadata, cache: KVCache
    ) -> mx.array:  # (num_tokens, hidden)
        # The whole layer in one op, else None; a layer whose attention is not
        # llama.Attention's own keeps the halves (that attention runs between them).
        if cpu_layer.attends_as_llama(self):
            h = cpu_layer.decoder_layer(self, x, positions, md, cache)
            if h is not None:
                return h
        attn = self.self_attn
        qkv = cpu_layer.attention_input(attn, self.input_layernorm, x, positions)
        if qkv is None:
            qkv = attn.project(self.input_layernorm(x), positions)
        out = attn.attend(qkv, md, cache)  # (num_tokens, num_heads, head_dim)
        h = cpu_layer.output_mlp(self, x, out)
        if h is not None:
            return h
        h = x + attn.o_proj(out.reshape(x.shape[0], -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class CpuLayers:
    """``run_layers`` of a llama.DecoderStack or a PipelineStage: every layer in one op
    where that applies (the kept arguments: ``_stack_args``)."""

    _stack_args: stack.StackArgs

    def run_layers(
        self, h: mx.array, positions: mx.array, md: AttentionMetadata, cache: KVCache
    ) -> mx.array:  # (num_tokens, hidden)
        out = stack.decoder_stack(self._stack_args, self.layers, h, positions, md, cache)
        return super().run_layers(h, positions, md, cache) if out is None else out


class CpuDecoderStack(CpuLayers):
    """A llama.DecoderStack whose quantized embedding's lookup is one op where it applies."""

    def __call__(
        self,
        input_ids: mx.array,  # (num_tokens,) int32
        positions: mx.array,
        md: AttentionMetadata,
        cache: KVCache,
        logits_indices: mx.array | None,
    ) -> mx.array:  # (num_rows, hidden)
        h = cpu_layer.embed(self.embed_tokens, input_ids)
        if h is None:
            return super().__call__(input_ids, positions, md, cache, logits_indices)
        h = self.run_layers(h, positions, md, cache)
        return self.norm(select_rows(h, logits_indices))


# The model classes that get a fused forward, and the forward each gets.
_FORWARDS: list[tuple[type, type]] = [
    (llama.DecoderLayer, CpuDecoderLayer),
    (llama.DecoderStack, CpuDecoderStack),
    (PipelineStage, CpuLayers),
]


@cache
def _fused_class(base: type, forward: type) -> type:
    """``base`` with ``forward``'s methods first (one class per pair, made once)."""
    return type(base.__name__, (forward, base), {"__module__": base.__module__})


def _forward_for(module: nn.Module) -> type | None:
    """The fused forward ``module`` takes, or None (another module, already bound, or a
    subclass that defines its own forward: it keeps it)."""
    base = type(module)
    for cls, forward in _FORWARDS:
        if not isinstance(module, cls) or issubclass(base, forward):
            continue
        own = {n for k in forward.__mro__[:-1] for n, v in vars(k).items() if callable(v)}
        if all(getattr(base, name) is getattr(cls, name) for name in own):
            return forward
    return None


def bind_forwards(model: nn.Module) -> int:
    """Bind the fused CPU forwards onto ``model``'s llama-family decoder layers, decoder
    stack or pipeline stage, where its linear layers run in the kernels (else nothing
    changes); how many modules were bound."""
    modules = [m for _, m in model.named_modules()]
    if not any(isinstance(m, kernels.CpuQuantizedLinear) for m in modules):
        return 0
    count = 0
    for module in modules:
        forward = _forward_for(module)
        if forward is None:
            continue
        module.__class__ = _fused_class(type(module), forward)
        if isinstance(module, CpuLayers):
            module._stack_args = stack.StackArgs()  # (a plain object: never a parameter)
        count += 1
    return count


def install(model: nn.Module, dtype: mx.Dtype = mx.float32) -> int:
    """Run ``model``'s supported quantized layers in the CPU kernels and bind the fused
    forwards onto it; how many quantized layers the kernels run. ``dtype``: the
    activations' (see kernels.use_kernels)."""
    count = kernels.use_kernels(model, dtype)
    bind_forwards(model)
    return count
