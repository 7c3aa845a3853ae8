"""Tensor parallelism for the hand-written decoders (llama, mistral, qwen2, qwen3).

Every linear layer is split by its output rows, and the activations a rank needs whole
are gathered, so each rank computes its outputs with the same kernels, on the same
inputs, in the same order as one process::

    x (replicated) -> q/k/v_proj: rows split by head  -> attention on this rank's heads
                   -> gather heads -> o_proj: rows split -> gather     -> h (replicated)
    h (replicated) -> gate/up_proj: rows split        -> SwiGLU on this rank's slice
                   -> gather       -> down_proj: rows split -> gather  -> (replicated)

Megatron's split (o_proj and down_proj by input columns, one all_sum of partial
products) saves two collectives per layer, but its sum adds the partial products in
another order than one process's dot product. With int8 activations (the CPU kernels
round each block of 32 values to int8) a last-bit difference flips a rounding by a whole
quantum at the next layer and grows from there: on SmolLM2-135M split 3 ways, teacher-
forced log-probs moved by up to ~0.4 nats. Split by rows, each output is one process's
dot product: the log-probs are the same bits (tests/test_tensor_parallel.py).

A gather is an ``mx.distributed.all_sum`` of this rank's slice placed in zeros
(:func:`gather_columns`): adding zeros is exact, and all_sum is the one collective
every backend (ring, JACCL, MPI) has. It moves as many bytes as Megatron's all_sum of
the same width.

Rank r holds query heads [r*H/N, (r+1)*H/N) and KV heads [r*KV/N, (r+1)*KV/N): with
contiguous splits a local query head still maps to its own local KV head (GQA), so the
attention code and the KV pool (num_kv_heads/N heads per rank) need no change.

Weights are split with MLX's ``shard_inplace`` ("all-to-sharded", float and quantized
alike: quantized weights are packed along their input columns, so a row split is any
whole rows), keeping each layer's class: mlxserve's CPU quantized kernels and the Metal
path keep running them.

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

__all__ = ["GatherInputAndOutput", "check_tensor_parallel", "gather_columns", "shard_model"]


def gather_columns(part: mx.array, group: mx.distributed.Group) -> mx.array:
    """Every rank's ``part`` (tokens, columns) side by side, in rank order: (tokens,
    columns * ranks), exactly (an all_sum of each part in zeros)."""
    rank, size = group.rank(), group.size()
    width = part.shape[-1]
    padded = mx.pad(part, [(0, 0)] * (part.ndim - 1) + [(rank * width, (size - 1 - rank) * width)])
    return mx.distributed.all_sum(padded, group=group)


class GatherInputAndOutput(nn.Module):
    """A linear layer holding a slice of its output rows that takes this rank's slice of
    its input: it gathers the input, computes its rows, gathers the output."""

    def __init__(self, linear: nn.Module, group: mx.distributed.Group) -> None:
        super().__init__()
        self.linear = linear
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        return gather_columns(self.linear(gather_columns(x, self._group)), self._group)


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
    if args.hidden_size % size:
        raise ParameterError(
            f"tensor_parallel_size {size} must divide hidden_size ({args.hidden_size}) of "
            f"this model",
            parameter="tensor_parallel_size",
        )


def shard_model(model: llama.Model, group: mx.distributed.Group) -> None:
    """Keep this rank's shard of ``model``'s layers (in place); replicated embeddings/head."""
    size = group.size()
    check_tensor_parallel(model, size)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            shard_inplace(linear, "all-to-sharded", group=group)
        for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            shard_inplace(linear, "all-to-sharded", group=group)
        attn.o_proj = GatherInputAndOutput(attn.o_proj, group)
        mlp.down_proj = GatherInputAndOutput(mlp.down_proj, group)
        attn.num_heads //= size
        attn.num_kv_heads //= size
    model.num_kv_heads //= size  # the KV pool's layout: this rank's heads only
    model.tp_group = group
    mx.eval(model.parameters())
