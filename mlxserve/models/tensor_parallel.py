"""Tensor parallelism for the hand-written decoders (llama, mistral, qwen2, qwen3).

Megatron-style, one all_sum per attention block and one per MLP::

    x (replicated) -> q/k/v_proj: rows split by head  -> attention on this rank's heads
                   -> o_proj: columns split by head  -> all_sum -> + bias (once)
    h (replicated) -> gate/up_proj: rows split       -> SwiGLU on this rank's slice
                   -> down_proj: columns split       -> all_sum -> + bias (once)

Rank r holds query heads [r*H/N, (r+1)*H/N) and KV heads [r*KV/N, (r+1)*KV/N): with
contiguous splits a local query head still maps to its own local KV head (GQA), so the
attention code and the KV pool (num_kv_heads/N heads per rank) need no change.

Weights are split with MLX's ``shard_inplace`` (all-to-sharded / sharded-to-all, float and
quantized alike), keeping each layer's class: mlxserve's CPU quantized kernels and the
Metal path keep running them. The reduction is an explicit ``mx.distributed.all_sum``
(:class:`ShardedToAll`), where MLX's ShardedToAllLinear would put it, bias added after.

Embeddings and the LM head stay replicated: every rank then has the full logits without
a gather of vocab slices, and they are a small part of a large model (a 70B llama at
4 bits: ~0.5 GB of embeddings and head vs ~35 GB of layers).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace

from mlxserve.exceptions import ParameterError
from mlxserve.models import llama

__all__ = ["ShardedToAll", "check_tensor_parallel", "shard_model"]


class ShardedToAll(nn.Module):
    """A linear layer holding a slice of its input columns; sums the partial products
    of every rank, then adds the bias once."""

    def __init__(self, linear: nn.Module, group: mx.distributed.Group) -> None:
        super().__init__()
        bias = linear.get("bias") if isinstance(linear, nn.Module) else None
        if bias is not None:
            del linear["bias"]  # added after the sum: every rank adding it would count it N times
            self.bias = bias
        self.linear = linear
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(self.linear(x), group=self._group)
        return y + self["bias"] if "bias" in self else y


def _input_dims(linear: nn.Module) -> int:
    if isinstance(linear, nn.QuantizedLinear):
        return linear.weight.shape[-1] * 32 // linear.bits
    return linear.weight.shape[-1]


def require_llama(model: nn.Module, field: str, size: int) -> None:
    """ParameterError on ``field`` unless ``model`` is the hand-written llama family (the
    only one split across processes, by tensor or pipeline parallelism)."""
    if not isinstance(model, llama.Model):
        raise ParameterError(
            f"{field} {size} needs one of the hand-written llama, mistral, qwen2, qwen3 "
            f"models; this model ({type(model).__module__}) runs in one process only",
            parameter=field,
        )


def check_tensor_parallel(model: nn.Module, size: int) -> None:
    """ParameterError (field tensor_parallel_size) if ``model`` cannot be split ``size`` ways."""
    require_llama(model, "tensor_parallel_size", size)
    args = model.args
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    if heads % size or kv_heads % size:
        common = math.gcd(heads, kv_heads)
        fits = [n for n in range(1, common + 1) if common % n == 0]
        raise ParameterError(
            f"tensor_parallel_size {size} must divide both num_attention_heads ({heads}) and "
            f"num_key_value_heads ({kv_heads}) of this model: each rank holds whole KV heads; "
            f"sizes that fit: {', '.join(map(str, fits))}",
            parameter="tensor_parallel_size",
        )
    if args.intermediate_size % size:
        raise ParameterError(
            f"tensor_parallel_size {size} must divide intermediate_size "
            f"({args.intermediate_size}) of this model",
            parameter="tensor_parallel_size",
        )
    layer = model.model.layers[0]
    for name, linear in (("o_proj", layer.self_attn.o_proj), ("down_proj", layer.mlp.down_proj)):
        group_size = getattr(linear, "group_size", None)
        if group_size and (_input_dims(linear) // size) % group_size:
            raise ParameterError(
                f"tensor_parallel_size {size}: {name} has {_input_dims(linear)} quantized input "
                f"columns in groups of {group_size}; a rank's share "
                f"({_input_dims(linear) // size}) must be whole groups",
                parameter="tensor_parallel_size",
            )


def shard_model(model: llama.Model, group: mx.distributed.Group) -> None:
    """Keep this rank's shard of ``model``'s layers (in place); replicated embeddings/head."""
    size = group.size()
    check_tensor_parallel(model, size)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            shard_inplace(linear, "all-to-sharded", group=group)
        for linear in (attn.o_proj, mlp.down_proj):
            shard_inplace(linear, "sharded-to-all", group=group)
        attn.o_proj = ShardedToAll(attn.o_proj, group)
        mlp.down_proj = ShardedToAll(mlp.down_proj, group)
        attn.num_heads //= size
        attn.num_kv_heads //= size
    model.num_kv_heads //= size  # the KV pool's layout: this rank's heads only
    model.tp_group = group
    mx.eval(model.parameters())
