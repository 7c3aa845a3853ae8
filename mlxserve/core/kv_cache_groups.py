"""One KV cache group's blocks per request: allocation, prefix hits, window release.

Every group keeps its own block table per request, drawn from the shared BlockPool. A
table is indexed by position (block i holds tokens i * block_size ..), so a windowed group
puts the null block where it released a block::

    window 8, block_size 4, 14 tokens computed; the next token (14) sees 7..14
    table: | null | b9 (4..7) | b2 (8..11) | b5 (12..15) |     block 0 (0..3) released

Prefix-cache hashes are the request's chained block hashes, tagged with the group id when
there are several groups (the same tokens have different blocks in each group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlxserve.core.block_pool import BlockHash, BlockPool, KVCacheBlock
from mlxserve.core.request import Request
from mlxserve.kv_cache_spec import KVCacheGroupSpec
from mlxserve.utils import cdiv

TokenIds = Callable[[int], Sequence[int]]  # block index -> that block's token ids


class GroupManager:
    """Blocks of one KV cache group (vLLM's SingleTypeKVCacheManager, for full attention
    and sliding windows: ``spec.window`` None or W tokens)."""

    def __init__(
        self,
        spec: KVCacheGroupSpec,
        group_id: int,
        block_pool: BlockPool,
        block_size: int,
        tag_hashes: bool,
        caching: bool = False,
    ) -> None:
        self.spec = spec
        self.caching = caching
        self.window = spec.window
        self.block_pool = block_pool
        self.block_size = block_size
        self._tag = bytes([group_id]) if tag_hashes else b""
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the cache (or null).
        self.num_cached_blocks: dict[str, int] = {}

    def key(self, block_hash: BlockHash) -> BlockHash:
        """The block pool's key for this group's copy of a block."""
        return block_hash + self._tag

    # ------------------------------------------------------------- prefix hits
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], token_ids: TokenIds, max_blocks: int
    ) -> list[KVCacheBlock]:
        """Cached blocks for the longest prefix of at most ``max_blocks`` blocks this group
        can resume from: the hit is ``len(result)`` blocks (null where not needed)."""
        pool = self.block_pool
        if self.window is None:
            hit: list[KVCacheBlock] = []
            for i in range(max_blocks):
                block = pool.get_cached_block(self.key(block_hashes[i]), token_ids(i))
                if block is None:
                    break
                hit.append(block)
            return hit
        # A windowed group resumes at e blocks if the blocks holding the window behind
        # position e * block_size are cached; scan from the right for the first such e.
        run: list[KVCacheBlock] = []  # cached blocks ending just before index i + 1, reversed
        for i in range(max_blocks - 1, -1, -1):
            block = pool.get_cached_block(self.key(block_hashes[i]), token_ids(i))
            if block is None:
                run = []
                continue
            run.append(block)
            end = i + len(run)  # candidate hit: blocks [0, end)
            first = self._first_needed_block(end * self.block_size)
            if i <= first:
                return [self.block_pool.null_block] * first + run[::-1][first - i :]
        return []

    def _first_needed_block(self, num_computed: int) -> int:
        """First block the next token (at position ``num_computed``) still attends to."""
        if self.window is None:
            return 0
        return max(num_computed - self.window + 1, 0) // self.block_size

    # ------------------------------------------------------------- allocation
    def remove_skipped_blocks(
        self, request_id: str, num_computed: int, unregistered_too: bool = False
    ) -> int:
        """Release (and null out) the blocks no future token of the request attends to;
        the earliest are queued to be evicted first. How many were released.

        With prefix caching, blocks not yet registered stay (unless ``unregistered_too``:
        the pool needs them): with async scheduling the next step is scheduled before the
        last one's blocks are registered (cache_blocks), and a block released unregistered
        is lost to the prefix cache (a prompt longer than the window, computed in one
        chunk, would keep none of its blocks). They leave at the next step's scheduling.
        """
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or self.window is None:
            return 0
        end = self._first_needed_block(num_computed)
        if self.caching and not unregistered_too:
            end = min(end, self.num_cached_blocks.get(request_id, 0))
        null = self.block_pool.null_block
        freed = []
        for i in range(min(end, len(blocks))):
            if blocks[i] is not null:
                freed.append(blocks[i])
                blocks[i] = null
        self.block_pool.free_blocks(freed)
        return len(freed)

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed: Sequence[KVCacheBlock]
    ) -> int:
        """New blocks needed for ``num_tokens`` tokens (hits in ``new_computed`` included)."""
        held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed)
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def take_hits(self, request_id: str, new_computed: Sequence[KVCacheBlock]) -> None:
        """Share the prefix-cache hits (ref_cnt + 1) at admission. Every group takes its hits
        before any group takes new blocks: a hit still in the free queue must not be handed
        out as another group's new block."""
        assert request_id not in self.req_to_blocks, request_id
        self.req_to_blocks[request_id] = list(new_computed)
        self.num_cached_blocks[request_id] = len(new_computed)
        null = self.block_pool.null_block
        self.block_pool.touch(b for b in new_computed if b is not null)

    def allocate(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """New blocks up to ``num_tokens`` tokens (after take_hits at admission); returns
        them. The caller checked they fit."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        self.num_cached_blocks.setdefault(request_id, 0)
        new = self.block_pool.get_new_blocks(
            self.num_blocks_to_allocate(request_id, num_tokens, ())
        )
        blocks.extend(new)
        return new

    def free_excess_blocks(self, request_id: str, num_tokens: int) -> None:
        """Release the blocks past the first ``num_tokens`` tokens (those only rejected
        speculative drafts used), last block first."""
        blocks = self.req_to_blocks.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        assert keep >= self.num_cached_blocks.get(request_id, 0)
        excess = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(excess))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks made full by its first num_computed_tokens tokens."""
        rid = request.request_id
        bs = self.block_size
        start = self.num_cached_blocks.get(rid, 0)
        end = num_computed_tokens // bs
        if end <= start:
            return
        blocks = self.req_to_blocks[rid]
        assert end <= len(blocks) and end <= len(request.block_hashes)
        null = self.block_pool.null_block
        # A released block was registered before it left the window (remove_skipped_blocks).
        indices = [i for i in range(start, end) if blocks[i] is not null]
        self.block_pool.cache_full_blocks(
            [blocks[i] for i in indices],
            [self.key(request.block_hashes[i]) for i in indices],
            [request.get_token_ids(i * bs, (i + 1) * bs) for i in indices],
        )
        self.num_cached_blocks[rid] = end

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first, so its prefix is evicted last."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (a fresh list; 0 = null)."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]
