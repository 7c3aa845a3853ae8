"""Reusable test helpers: tiny checkpoints, a minimal block-pool runner, mlx-lm oracles.

``BlockPoolRunner`` is a stand-in for the engine's runner: it hands out blocks from a
shuffled free list, builds ``AttentionMetadata`` and runs a model step over any mix of
prefill chunks and decodes. The mlx-lm helpers run the independent reference.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlxserve.loader.local import read_model_dir
from mlxserve.models import KVCache, build_model
from mlxserve.ops import AttentionMetadata

# Llama 3.1 RoPE scaling shrunk to tiny models: with head_dim 16 and base 5e5 the
# wavelengths (6.3, 32.4, 167, ...) fall in all three bands (kept < 16, blended 16..64,
# scaled > 64).
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def tiny_config(model_type: str = "llama", **overrides: Any) -> dict[str, Any]:
    """A tiny GQA config (4 heads / 2 KV heads, head_dim 16) in HF config.json form."""
    config = {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    return config | overrides


def save_checkpoint(path: Path, config: dict[str, Any], weights: dict[str, mx.array]) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (the mlx-community layout) into ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


def load_checkpoint(path: Path, dtype: mx.Dtype | None = None) -> nn.Module:
    """Load a checkpoint directory with mlxserve.loader's directory reader.

    Unlike ``load_model(path, skip_tokenizer_init=True)`` this keeps the checkpoint's
    dtypes (``dtype=None``), e.g. the float16 scales mlx-lm oracles compute with.
    """
    config, weights = read_model_dir(path)
    return build_model(config, weights, dtype)


def perturb_norms_and_biases(model: nn.Module, seed: int, embed_scale: float = 0.2) -> None:
    """Norm weights (init 1) and biases (init 0 in some layers) get random values.

    So a swapped, skipped or misnamed norm or bias changes the output. Token embeddings
    shrink by ``embed_scale`` so the residual stream does not just echo the input token
    (which makes tied-embedding models repeat their last token forever).
    """
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    updates = []
    for (name, value), key in zip(params, keys, strict=True):
        if not mx.issubdtype(value.dtype, mx.floating):
            continue
        noise = mx.random.normal(value.shape, key=key)
        if name.endswith("embed_tokens.weight"):
            updates.append((name, embed_scale * value))
        elif "norm" in name and name.endswith(".weight"):
            updates.append((name, 1.0 + 0.2 * noise))
        elif name.endswith(".bias"):
            updates.append((name, 0.2 * noise))
    model.update(tree_unflatten(updates))


def make_mlx_lm_checkpoint(
    path: Path,
    config: dict[str, Any],
    seed: int = 0,
    quantize: dict[str, Any] | None = None,
) -> tuple[nn.Module, Path]:
    """A seeded random mlx-lm model (the oracle) and its checkpoint directory.

    ``quantize``: kwargs for ``mlx_lm.utils.quantize_model`` (group_size, bits,
    quant_predicate); the saved config then carries mlx-lm's ``quantization`` entry.
    """
    from mlx_lm.utils import MODEL_REMAPPING, quantize_model

    model_type = config["model_type"]
    arch = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    model_cls, args_cls = arch.Model, arch.ModelArgs
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    perturb_norms_and_biases(model, seed)
    if quantize is not None:
        model, config = quantize_model(model, config, **quantize)
    mx.eval(model.parameters())
    model.eval()
    return model, save_checkpoint(path, config, dict(tree_flatten(model.parameters())))


def mlx_lm_chunk_logits(model: nn.Module, chunks: list[list[int]]) -> list[np.ndarray]:
    """Logits of every token of each chunk, fed in order through one mlx-lm KV cache."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = []
    for chunk in chunks:
        logits = model(mx.array(chunk, dtype=mx.int32)[None], cache=cache)[0]
        out.append(np.array(logits.astype(mx.float32)))
    return out


def mlx_lm_greedy(
    model: nn.Module, prompt: list[int], num_tokens: int
) -> tuple[list[int], np.ndarray]:
    """Greedy continuation of one prompt with mlx-lm and its own KV cache.

    Returns the tokens and the (num_tokens, vocab) logits each was picked from.
    """
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens: list[int] = []
    rows = []
    feed = prompt
    for _ in range(num_tokens):
        logits = model(mx.array(feed, dtype=mx.int32)[None], cache=cache)[0, -1]
        rows.append(np.array(logits.astype(mx.float32)))
        feed = [int(np.argmax(rows[-1]))]
        tokens.extend(feed)
    return tokens, np.stack(rows)


class BlockPoolRunner:
    """Runs a model over a simple block pool; one ``step`` = one engine step."""

    def __init__(
        self,
        model: nn.Module,
        num_blocks: int = 64,
        block_size: int = 4,
        dtype: mx.Dtype = mx.float32,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.cache = KVCache.allocate_for(model, num_blocks, block_size, dtype)
        # Block 0 is the null block; the rest are handed out in a shuffled order so
        # block tables are never contiguous.
        rng = np.random.default_rng(seed)
        self.free_blocks = [int(b) for b in rng.permutation(np.arange(1, num_blocks))]
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.logits_dtype: mx.Dtype | None = None

    def step(
        self,
        work: list[tuple[str, list[int]]],
        all_logits: bool = False,
        pad_to: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Run new tokens for each (request_id, tokens); decodes are moved to the front.

        Returns each request's last-token logits (vocab,), or with ``all_logits`` its
        (num_new_tokens, vocab) logits. ``pad_to`` pads the flat batch like a bucketing runner.
        """
        work = [w for w in work if len(w[1]) == 1] + [w for w in work if len(w[1]) > 1]
        query_lens, context_lens, tables = [], [], []
        for request_id, tokens in work:
            context = self.num_computed.get(request_id, 0) + len(tokens)
            table = self.block_tables.setdefault(request_id, [])
            while len(table) * self.block_size < context:
                table.append(self.free_blocks.pop())
            query_lens.append(len(tokens))
            context_lens.append(context)
            tables.append(table)
        md = AttentionMetadata.build(
            query_lens, context_lens, tables, self.block_size, num_tokens_padded=pad_to
        )
        num_tokens = sum(query_lens)
        padding = max(pad_to or 0, num_tokens) - num_tokens
        input_ids = [t for _, tokens in work for t in tokens] + [0] * padding
        positions = md.positions() + [0] * padding
        ends = np.cumsum(query_lens)
        logits_indices = None if all_logits else mx.array(ends - 1, dtype=mx.int32)
        logits = self.model(
            mx.array(input_ids, dtype=mx.int32),
            mx.array(positions, dtype=mx.int32),
            md,
            self.cache,
            logits_indices,
        )
        mx.eval(logits, self.cache.keys, self.cache.values)
        self.logits_dtype = logits.dtype  # the model's own output dtype, before the cast
        logits = np.array(logits.astype(mx.float32))
        out = {}
        for i, (request_id, tokens) in enumerate(work):
            self.num_computed[request_id] = context_lens[i]
            out[request_id] = logits[ends[i] - len(tokens) : ends[i]] if all_logits else logits[i]
        return out

    def free(self, request_id: str) -> None:
        """Return a request's blocks to the free list."""
        self.free_blocks.extend(reversed(self.block_tables.pop(request_id)))
        self.num_computed.pop(request_id)

    def fork_prefix(self, source: str, request_id: str, num_tokens: int) -> None:
        """A prefix-cache hit: ``request_id`` starts with ``source``'s first ``num_tokens``
        (whole blocks) already computed, in ``source``'s own blocks.

        No reference counts here: free at most one of the two requests.
        """
        assert num_tokens % self.block_size == 0 and num_tokens <= self.num_computed[source]
        self.block_tables[request_id] = self.block_tables[source][: num_tokens // self.block_size]
        self.num_computed[request_id] = num_tokens


def greedy_generate(
    runner: BlockPoolRunner,
    prompts: dict[str, list[int]],
    num_tokens: int,
    join_at: dict[str, int] | None = None,
) -> tuple[dict[str, list[int]], dict[str, np.ndarray]]:
    """Greedy decoding of several requests batched together through ``runner``.

    ``join_at[request_id]`` = the step at which that request's prompt is first scheduled
    (default 0), so prefills of late joiners share steps with others' decodes.
    Returns each request's tokens and the (num_tokens, vocab) logits they came from.
    """
    join_at = join_at or {}
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    rows: dict[str, list[np.ndarray]] = {rid: [] for rid in prompts}
    step = 0
    while any(len(t) < num_tokens for t in tokens.values()):
        work = []
        for rid, prompt in prompts.items():
            if join_at.get(rid, 0) > step or len(tokens[rid]) >= num_tokens:
                continue
            work.append((rid, [tokens[rid][-1]] if tokens[rid] else prompt))
        for rid, logits in runner.step(work).items():
            rows[rid].append(logits)
            tokens[rid].append(int(np.argmax(logits)))
        step += 1
    return tokens, {rid: np.stack(r) for rid, r in rows.items()}


def greedy_generate_budgeted(
    runner: BlockPoolRunner,
    prompts: dict[str, list[int]],
    num_tokens: int,
    budget: int,
    preempt_at: dict[str, int] | None = None,
) -> tuple[dict[str, list[int]], dict[str, np.ndarray]]:
    """Greedy decoding under a per-step token budget, as the scheduler runs it.

    Each step, decodes go first (one token each), then prefill chunks in request order take
    what is left of ``budget``, so prompts longer than the budget are chunked and chunks share
    steps with decodes. ``preempt_at[request_id]`` = a step at whose start that request is
    preempted: its blocks are freed and its prompt plus the tokens generated so far are
    recomputed (the scheduler's recompute preemption).
    Returns each request's tokens and the (num_tokens, vocab) logits they came from.
    """
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    rows: dict[str, list[np.ndarray]] = {rid: [] for rid in prompts}
    computed = dict.fromkeys(prompts, 0)  # tokens of prompt + output in the pool
    step = 0
    while any(len(t) < num_tokens for t in tokens.values()):
        for rid, at in (preempt_at or {}).items():
            if at == step and computed[rid]:
                runner.free(rid)
                computed[rid] = 0
        live = [rid for rid in prompts if len(tokens[rid]) < num_tokens]
        seqs = {rid: prompts[rid] + tokens[rid] for rid in live}
        decodes = [rid for rid in live if len(seqs[rid]) - computed[rid] == 1]
        work = [(rid, seqs[rid][-1:]) for rid in decodes[:budget]]
        left = budget - len(work)
        for rid in live:
            todo = len(seqs[rid]) - computed[rid]
            if rid in decodes or left <= 0:
                continue
            n = min(todo, left)
            work.append((rid, seqs[rid][computed[rid] : computed[rid] + n]))
            left -= n
        out = runner.step(work)
        for rid, chunk in work:
            computed[rid] += len(chunk)
            if computed[rid] == len(seqs[rid]):  # the chunk reached the end: sample
                rows[rid].append(out[rid])
                tokens[rid].append(int(np.argmax(out[rid])))
        step += 1
    return tokens, {rid: np.stack(r) for rid, r in rows.items()}
