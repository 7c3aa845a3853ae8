"""KVCacheManager: the scheduler's only window into KV memory (blocks, prefix hits, frees).

Prefix caching hashes FULL blocks only, as a chain::

    tokens: | t0 .. t15 | t16 .. t31 | t32 .. t40 (partial) |
    hashes:   h0 = H(root, block 0, salt)
                          h1 = H(h0, block 1)
                                       (never hashed while partial)

so a block's hash names its whole prefix. Hashes are SHA-256 (an attacker cannot forge a
collision to read another user's cache), and a hit is also checked against the block's
stored token ids.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from mlxserve.core.block_pool import BlockHash, BlockPool, KVCacheBlock
from mlxserve.core.request import Request
from mlxserve.utils import cdiv

ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"mlxserve prefix cache root").digest()


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    """Chained hash of (parent block hash, the block's token ids, extra keys)."""
    h = hashlib.sha256(parent_block_hash if parent_block_hash is not None else ROOT_BLOCK_HASH)
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


class KVCacheManager:
    """Allocates blocks per request, finds cached prefixes and frees blocks.

    Prefix-cache stats are cumulative counters, counted in tokens at a request's first
    admission (not on retries, not on resumption after preemption):
    ``prefix_cache_queries`` (tokens looked up) and ``prefix_cache_hits`` (tokens found).
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool = True,
        initial_blocks: int | None = None,
    ) -> None:
        assert block_size >= 1, block_size  # EngineConfig checks it
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, initial_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the cache map.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return self.block_pool.get_usage()

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (the null block excluded)."""
        return self.block_pool.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now."""
        return self.block_pool.get_num_free_blocks()

    def _use_prefix_cache(self, request: Request) -> bool:
        # Prompt logprobs need logits for every prompt token, so nothing may be skipped.
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), request.num_tokens // bs):
            extra = (request.cache_salt,) if i == 0 and request.cache_salt else None
            parent = hash_block_tokens(parent, request.get_token_ids(i * bs, (i + 1) * bs), extra)
            hashes.append(parent)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request: (blocks, number of tokens they hold).

        Never the whole sequence: at least its last token is left to compute, so the
        model produces logits for the next one.
        """
        if not self._use_prefix_cache(request):
            return [], 0
        self.update_block_hashes(request)
        bs = self.block_size
        max_hit_blocks = (request.num_tokens - 1) // bs
        blocks: list[KVCacheBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_hit_blocks]):
            block = self.block_pool.get_cached_block(
                block_hash, request.get_token_ids(i * bs, (i + 1) * bs)
            )
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * bs

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens; return the newly allocated blocks.

        ``new_computed_blocks`` are prefix-cache hits from get_computed_blocks (only at
        admission); they are shared (ref_cnt + 1), not copied. Returns None, changing
        nothing, when the free blocks do not suffice.
        """
        assert num_new_tokens >= 1, num_new_tokens
        bs = self.block_size
        req_blocks = self.req_to_blocks.get(request.request_id)
        is_first_allocation = req_blocks is None
        assert is_first_allocation or not new_computed_blocks, "cache hits only at admission"
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        num_required = cdiv(num_computed + num_new_tokens, bs)
        num_held = len(req_blocks or ()) + len(new_computed_blocks)
        num_new_blocks = max(0, num_required - num_held)
        # Hits sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
            if self._use_prefix_cache(request) and request.num_preemptions == 0:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(new_computed_blocks) * bs
        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks made full by its first num_computed_tokens tokens."""
        if not self.enable_caching:
            return
        rid = request.request_id
        bs = self.block_size
        start = self.num_cached_blocks.get(rid, 0)
        end = num_computed_tokens // bs
        if end <= start:
            return
        self.update_block_hashes(request)
        blocks = self.req_to_blocks[rid]
        assert end <= len(blocks) and end <= len(request.block_hashes)
        self.block_pool.cache_full_blocks(
            blocks[start:end],
            request.block_hashes[start:end],
            [request.get_token_ids(i * bs, (i + 1) * bs) for i in range(start, end)],
        )
        self.num_cached_blocks[rid] = end

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first, so its prefix is evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request: Request) -> list[int]:
        """The request's block table as block ids (a fresh list)."""
        return [block.block_id for block in self.req_to_blocks.get(request.request_id, ())]

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes (e.g. after loading new weights)."""
        self.block_pool.reset_prefix_cache()
