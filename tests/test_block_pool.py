"""BlockPool and its free queue: exact block ids, ref counts and free-queue order."""

from __future__ import annotations

import pytest

from mlxserve.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# ---------------------------------------------------------------- free queue


def test_free_queue_popleft_remove_append():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert len(queue) == 6
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]

    assert queue.popleft() is blocks[0]
    queue.remove(blocks[3])  # from the middle
    queue.remove(blocks[5])  # the tail
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4]
    assert blocks[3].prev_free_block is None and blocks[3].next_free_block is None

    queue.append(blocks[3])
    queue.append_n([blocks[0], blocks[5]])
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4, 3, 0, 5]
    assert queue.num_free_blocks == 6

    assert ids(queue.popleft_n(4)) == [1, 2, 4, 3]
    assert ids(queue.get_all_free_blocks()) == [0, 5]


def test_free_queue_empty_and_double_free():
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match="asked for 3 blocks, only 2 free"):
        queue.popleft_n(3)
    assert len(queue) == 2  # a failed popleft_n takes nothing
    queue.popleft_n(2)
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    queue.append(blocks[1])
    with pytest.raises(AssertionError):
        queue.append(blocks[1])
    assert ids(queue.get_all_free_blocks()) == [1]


# ---------------------------------------------------------------- pool


def test_null_block_is_reserved():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == 0.0
    # Handing out every usable block never yields the null block.
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    # Freeing the null block (it pads tables) is a no-op.
    pool.free_blocks([pool.null_block])
    assert pool.get_num_free_blocks() == 0 and pool.null_block.ref_cnt == 0


def test_pool_rejects_too_few_blocks():
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(num_blocks=1)


def test_allocate_and_free_order():
    pool = BlockPool(num_blocks=8)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(2)
    assert ids(a) == [1, 2, 3] and ids(b) == [4, 5]
    assert [blk.ref_cnt for blk in a + b] == [1] * 5
    assert free_ids(pool) == [6, 7]
    assert pool.get_usage() == pytest.approx(5 / 7)

    pool.free_blocks(reversed(a))  # a request frees tail first
    assert free_ids(pool) == [6, 7, 3, 2, 1]
    assert [blk.ref_cnt for blk in a] == [0, 0, 0]
    # Reuse follows the queue: oldest free first.
    assert ids(pool.get_new_blocks(3)) == [6, 7, 3]
    assert free_ids(pool) == [2, 1]


def test_shared_block_freed_only_at_zero_refs():
    pool = BlockPool(num_blocks=4)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and free_ids(pool) == [2, 3]
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and free_ids(pool) == [2, 3, 1]
    with pytest.raises(AssertionError):
        pool.free_blocks([blk])  # ref_cnt would go below 0


def test_cache_hit_and_touch_pulls_block_from_free_queue():
    pool = BlockPool(num_blocks=6)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a[:2], [b"h0", b"h1"], [[1, 2], [3, 4]])
    assert a[0].block_hash == b"h0" and a[0].token_ids == (1, 2)
    assert a[2].block_hash is None
    assert pool.num_cached_blocks == 2

    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [4, 5, 3, 2, 1]
    hit = pool.get_cached_block(b"h1", [3, 4])
    assert hit is a[1]
    pool.touch([pool.get_cached_block(b"h0", [1, 2]), hit])
    assert a[0].ref_cnt == 1 and a[1].ref_cnt == 1
    assert free_ids(pool) == [4, 5, 3]
    pool.touch([hit])
    assert hit.ref_cnt == 2 and free_ids(pool) == [4, 5, 3]


def test_hash_collision_guard():
    pool = BlockPool(num_blocks=4)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"same"], [[7, 8, 9]])
    # A forged/colliding hash with other tokens must not hit.
    assert pool.get_cached_block(b"same", [7, 8, 10]) is None
    assert pool.get_cached_block(b"same", [7, 8]) is None
    assert pool.get_cached_block(b"same", [7, 8, 9]) is blocks[0]
    assert pool.get_cached_block(b"other", [7, 8, 9]) is None


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(num_blocks=4)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [b"h"], [[1]])
    pool.cache_full_blocks([second], [b"h"], [[1]])
    assert second.block_hash is None
    assert pool.get_cached_block(b"h", [1]) is first
    # Recycling the uncached duplicate leaves the entry alone.
    pool.free_blocks([second])
    assert ids(pool.get_new_blocks(2)) == [3, 2]
    assert pool.get_cached_block(b"h", [1]) is first


def test_lazy_eviction():
    pool = BlockPool(num_blocks=4)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [b"h0", b"h1"], [[1], [2]])
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [3, 2, 1]
    # Freed but not reused: still a hit.
    assert pool.get_cached_block(b"h0", [1]) is a[0]
    assert pool.get_cached_block(b"h1", [2]) is a[1]

    # Reuse two blocks: block 3 (never cached), then block 2 (h1) is evicted now.
    assert ids(pool.get_new_blocks(2)) == [3, 2]
    assert a[1].block_hash is None and a[1].token_ids is None
    assert pool.get_cached_block(b"h1", [2]) is None
    assert pool.get_cached_block(b"h0", [1]) is a[0]
    assert pool.num_cached_blocks == 1


def test_reset_prefix_cache():
    pool = BlockPool(num_blocks=5)
    used = pool.get_new_blocks(2)
    pool.cache_full_blocks(used, [b"a", b"b"], [[1], [2]])
    pool.free_blocks([used[1]])  # one free-but-cached, one in use
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert pool.get_cached_block(b"a", [1]) is None
    assert pool.get_cached_block(b"b", [2]) is None
    assert used[0].block_hash is None and used[0].ref_cnt == 1
    assert free_ids(pool) == [3, 4, 2]


def test_caching_disabled_registers_nothing():
    pool = BlockPool(num_blocks=3, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"h"], [[1]])
    assert blocks[0].block_hash is None
    assert pool.get_cached_block(b"h", [1]) is None


def test_pool_grows_on_demand_up_to_num_blocks() -> None:
    pool = BlockPool(num_blocks=10, initial_blocks=3)
    assert pool.num_allocated_blocks == 3
    assert pool.get_num_free_blocks() == 9  # 2 existing + 7 that can still be grown
    assert ids(pool.get_new_blocks(2)) == [1, 2]
    # Short by one: doubles to 6 blocks; new ones join the free queue in id order.
    assert ids(pool.get_new_blocks(1)) == [3]
    assert pool.num_allocated_blocks == 6
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 5]
    # Short by 4 with 2 free: grows to min(12, 10) = 10.
    assert ids(pool.get_new_blocks(6)) == [4, 5, 6, 7, 8, 9]
    assert pool.num_allocated_blocks == 10 and pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_cached_free_blocks_are_reused_before_growing() -> None:
    pool = BlockPool(num_blocks=8, initial_blocks=3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h"], [(1, 2)])
    pool.free_blocks([a, b])
    # Two free blocks (one holding a cached prefix) cover a request for two: no growth.
    assert ids(pool.get_new_blocks(2)) == [1, 2]
    assert pool.num_allocated_blocks == 3
    assert pool.get_cached_block(b"h", (1, 2)) is None  # evicted on reuse
