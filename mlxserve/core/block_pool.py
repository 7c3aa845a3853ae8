"""KVCacheBlock, the O(1) LRU free queue, and BlockPool (ref counts + prefix-cache map).

A block is ``block_size`` token slots of K/V in every layer. The pool hands blocks out,
counts references to them, and remembers full blocks by content hash so a later request
with the same prefix can reuse them (automatic prefix caching).

Free blocks sit in one queue, least recently freed at the head::

    head -> [b7] <-> [b3] <-> [b9 (cached, hash h)] <-> ... <- tail
    get_new_blocks() pops from the head; free_blocks() appends at the tail.

A freed block keeps its hash (it is still a prefix-cache hit) until it reaches the head
and is handed out again: eviction is lazy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# A block's content hash: opaque to the pool (the KV cache manager computes it).
BlockHash = bytes


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one KV block; the K/V data itself lives in the runner's arrays."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is in the prefix-cache map (it is full and its content known).
    block_hash: BlockHash | None = None
    # The block's token ids, kept to verify a hash hit against the real content.
    token_ids: tuple[int, ...] | None = None
    is_null: bool = False
    # Filled from the store (the disk tier) rather than computed: nothing to save.
    from_store: bool = False
    # Links of the free queue; both None when the block is not in it.
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)

    def reset_hash(self) -> None:
        """Forget the content (the block is about to be overwritten)."""
        self.block_hash = None
        self.token_ids = None
        self.from_store = False


class FreeKVCacheBlockQueue:
    """Doubly linked queue of free blocks with O(1) popleft, append and remove-anywhere.

    It links the blocks themselves (no per-operation allocation), between two sentinels.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (least recently freed) block."""
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first n blocks, head first."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (evicted last)."""
        assert block.prev_free_block is None and block.next_free_block is None, (
            f"block {block.block_id} is already free"
        )
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append blocks in order: the first one given is evicted first."""
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head (next to evict) first. O(n): for tests and debugging."""
        out = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """All KV blocks: allocation, ref counts, the LRU free queue and the prefix-cache map.

    Block 0 is the null block: taken out at init and never handed out. It pads block
    tables, and padding tokens write their K/V into it.

    The pool may start with ``initial_blocks`` and grow (doubling) up to ``num_blocks``
    when the free queue runs short, so memory follows the live working set instead of
    being committed at start-up. Cached-but-free blocks are reused before it grows.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, initial_blocks: int | None = None
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        start = num_blocks if initial_blocks is None else max(2, min(initial_blocks, num_blocks))
        self.blocks = [KVCacheBlock(i) for i in range(start)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # With a disk tier: blocks registered since the engine last copied them out
        # (block id -> hash, tokens); a block reused before that is dropped from here.
        self.pending_saves: dict[int, tuple[BlockHash, tuple[int, ...]]] | None = None
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take num_blocks blocks from the head of the free queue, ref_cnt 1 each.

        A block that still holds a cached prefix is evicted here, when it is reused.
        """
        missing = num_blocks - self.free_block_queue.num_free_blocks
        if missing > 0 and len(self.blocks) < self.num_blocks:
            self._grow(missing)
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            self._evict(block)
            block.from_store = False
            block.ref_cnt = 1
        return blocks

    def _grow(self, num_missing: int) -> None:
        """Add new blocks at the free queue's tail: at least num_missing, doubling if possible."""
        current = len(self.blocks)
        target = min(self.num_blocks, max(2 * current, current + num_missing))
        new = [KVCacheBlock(i) for i in range(current, target)]
        self.blocks.extend(new)
        self.free_block_queue.append_n(new)

    @property
    def num_allocated_blocks(self) -> int:
        """Blocks that exist now (null block included): the KV arrays' first dimension."""
        return len(self.blocks)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.pending_saves:
            self.pending_saves.pop(block.block_id, None)
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.reset_hash()

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        block_token_ids: Sequence[Sequence[int]],
    ) -> None:
        """Register full blocks under their content hashes so later requests can hit them.

        A block that is already cached keeps its entry; if another block already holds
        the same hash (two requests computed the same prefix at once), the newcomer
        stays uncached and is recycled normally.
        """
        if not self.enable_caching:
            return
        for block, block_hash, token_ids in zip(blocks, block_hashes, block_token_ids, strict=True):
            assert not block.is_null
            if block.block_hash is not None:
                assert block.block_hash == block_hash, "a cached block changed content"
                continue
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            block.token_ids = tuple(token_ids)
            self.cached_block_hash_to_block[block_hash] = block
            if self.pending_saves is not None and not block.from_store:
                self.pending_saves[block.block_id] = (block_hash, block.token_ids)

    def take_pending_saves(self) -> list[tuple[int, BlockHash, tuple[int, ...]]]:
        """(block id, hash, token ids) of the blocks registered since the last call, whose
        contents are still theirs."""
        if not self.pending_saves:
            return []
        out = [(block_id, h, tokens) for block_id, (h, tokens) in self.pending_saves.items()]
        self.pending_saves.clear()
        return out

    def get_cached_block(
        self, block_hash: BlockHash, token_ids: Sequence[int]
    ) -> KVCacheBlock | None:
        """The cached block with this hash, if its stored tokens equal token_ids."""
        block = self.cached_block_hash_to_block.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on (cache-hit) blocks, pulling free ones out of the free queue."""
        for block in blocks:
            assert not block.is_null
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching 0 join the free queue tail
        in the order given (the first given is evicted first)."""
        for block in blocks_in_eviction_order:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; blocks in use stay allocated, just unshared."""
        for block in self.cached_block_hash_to_block.values():
            block.reset_hash()
        self.cached_block_hash_to_block.clear()
        if self.pending_saves:
            self.pending_saves.clear()

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached-but-unused, not yet grown)."""
        return self.free_block_queue.num_free_blocks + self.num_blocks - len(self.blocks)

    def get_usage(self) -> float:
        """Fraction of usable blocks (the null block excluded) in use, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix-cache map."""
        return len(self.cached_block_hash_to_block)
