"""KVCacheManager: hashing, prefix hits, allocation, frees. Exact block ids and queue order."""

from __future__ import annotations

import hashlib

import pytest

from mlxserve.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from mlxserve.core.request import Request
from mlxserve.sampling_params import SamplingParams

BS = 4


def make_request(
    rid: str, tokens: list[int], prompt_logprobs: int | None = None, cache_salt: str | None = None
) -> Request:
    params = SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs)
    return Request(rid, tokens, params, cache_salt=cache_salt)


def admit(kv: KVCacheManager, req: Request) -> list[int]:
    """What the scheduler does at admission with an unlimited budget, then 'runs' the step."""
    hits, num_hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - num_hit, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)
    return table(kv, req)


def table(kv: KVCacheManager, req: Request) -> list[int]:
    """The request's block table (the one KV cache group of these tests)."""
    (ids,) = kv.get_block_ids(req)
    return ids


def hit_ids(hit) -> list[int]:
    (blocks,) = hit.blocks
    return [blk.block_id for blk in blocks]


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def refs(kv: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [kv.block_pool.blocks[i].ref_cnt for i in block_ids]


def test_hash_is_chained_over_parent_tokens_and_extra_keys():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h0, bytes) and len(h0) == hashlib.sha256().digest_size
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert h1 != hash_block_tokens(None, [5, 6, 7, 8])  # same tokens, other prefix
    assert h1 != hash_block_tokens(h0, [5, 6, 7, 9])
    assert h0 != hash_block_tokens(None, [1, 2, 3, 4], ("salt",))
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])
    # Token ids are hashed as 64-bit values, not truncated to bytes.
    assert hash_block_tokens(None, [256]) != hash_block_tokens(None, [0])


def test_block_hashes_cover_full_blocks_only_and_grow_incrementally():
    kv = KVCacheManager(BS, num_blocks=10)
    req = make_request("a", list(range(10)))
    kv.update_block_hashes(req)
    assert len(req.block_hashes) == 2  # tokens 8, 9 form a partial block
    first = list(req.block_hashes)
    req.output_token_ids += [10, 11]
    kv.update_block_hashes(req)
    assert req.block_hashes[:2] == first and len(req.block_hashes) == 3
    assert req.block_hashes[2] == hash_block_tokens(first[1], [8, 9, 10, 11])


def test_allocate_and_partial_block_not_cached():
    kv = KVCacheManager(BS, num_blocks=10)
    req = make_request("a", list(range(10)))
    assert admit(kv, req) == [1, 2, 3]
    assert refs(kv, [1, 2, 3]) == [1, 1, 1]
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9]
    pool = kv.block_pool
    assert pool.blocks[1].token_ids == (0, 1, 2, 3)
    assert pool.blocks[2].token_ids == (4, 5, 6, 7)
    assert pool.blocks[3].block_hash is None  # partial: never cached
    assert pool.num_cached_blocks == 2
    assert kv.usage == pytest.approx(3 / 9)


def test_prefix_hit_shares_blocks():
    kv = KVCacheManager(BS, num_blocks=10)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit = kv.get_computed_blocks(b)
    assert hit_ids(hits) == [1, 2] and num_hit == 8
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is not None
    assert table(kv, b) == [1, 2, 4]
    assert refs(kv, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert kv.prefix_cache_queries == 10 + 11 and kv.prefix_cache_hits == 8


def test_hit_never_covers_the_last_token():
    kv = KVCacheManager(BS, num_blocks=10)
    admit(kv, make_request("a", list(range(8))))
    # Same 8 tokens: 2 cached blocks, but the last token must be recomputed for logits.
    hits, num_hit = kv.get_computed_blocks(make_request("b", list(range(8))))
    assert hit_ids(hits) == [1] and num_hit == 4
    hits, num_hit = kv.get_computed_blocks(make_request("c", list(range(9))))
    assert hit_ids(hits) == [1, 2] and num_hit == 8


def test_prompt_logprobs_and_salt_skip_sharing():
    kv = KVCacheManager(BS, num_blocks=10)
    admit(kv, make_request("a", list(range(9))))
    assert kv.get_computed_blocks(make_request("b", list(range(9)), prompt_logprobs=1))[1] == 0
    assert kv.get_computed_blocks(make_request("c", list(range(9)), cache_salt="x"))[1] == 0
    salted = make_request("d", list(range(9)), cache_salt="x")
    admit(kv, salted)
    hits, _ = kv.get_computed_blocks(make_request("e", list(range(9)), cache_salt="x"))
    assert hit_ids(hits) == table(kv, salted)[:2]


def test_generated_tokens_are_cached():
    kv = KVCacheManager(BS, num_blocks=10)
    a = make_request("a", [1, 2, 3])
    admit(kv, a)  # blocks [1]
    a.output_token_ids += [4, 5, 6]  # three decode steps, one token each
    for _ in range(3):
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
        kv.cache_blocks(a, a.num_computed_tokens)
    assert a.num_computed_tokens == 6 and table(kv, a) == [1, 2]
    assert kv.block_pool.num_cached_blocks == 1  # tokens 4..5 fill only half of block 2
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7])
    hits, num_hit = kv.get_computed_blocks(b)
    assert hit_ids(hits) == [1] and num_hit == 4


def test_free_is_tail_first_and_lru():
    kv = KVCacheManager(BS, num_blocks=8)
    a = make_request("a", list(range(12)))
    b = make_request("b", list(range(100, 108)))
    assert admit(kv, a) == [1, 2, 3]
    assert admit(kv, b) == [4, 5]
    kv.free(a)
    assert free_ids(kv) == [6, 7, 3, 2, 1]
    kv.free(b)
    assert free_ids(kv) == [6, 7, 3, 2, 1, 5, 4]
    assert table(kv, a) == [] and refs(kv, list(range(1, 8))) == [0] * 7
    kv.free(a)  # freeing twice is a no-op
    assert free_ids(kv) == [6, 7, 3, 2, 1, 5, 4]


def test_lazy_eviction_keeps_freed_prefix_until_reused():
    kv = KVCacheManager(BS, num_blocks=6)
    a = make_request("a", list(range(12)))
    admit(kv, a)  # [1, 2, 3], all full and cached
    kv.free(a)
    assert free_ids(kv) == [4, 5, 3, 2, 1]
    # Freed: the whole prefix still hits (up to the last-token rule).
    hits, _ = kv.get_computed_blocks(make_request("q", list(range(13))))
    assert hit_ids(hits) == [1, 2, 3]
    # A 12-token unrelated request takes 4, 5, then evicts 3 (a's last block first).
    assert admit(kv, make_request("c", list(range(200, 212)))) == [4, 5, 3]
    hits, num_hit = kv.get_computed_blocks(make_request("q2", list(range(13))))
    assert hit_ids(hits) == [1, 2] and num_hit == 8


def test_hash_collision_guard():
    kv = KVCacheManager(BS, num_blocks=10)
    a = make_request("a", list(range(8)) + [99])
    admit(kv, a)
    # Forge a collision: another request claiming a's block hashes with other tokens.
    forged = make_request("f", [7, 7, 7, 7, 7, 7, 7, 7, 7])
    forged.block_hashes = list(a.block_hashes)
    assert kv.get_computed_blocks(forged)[1] == 0
    # Only the second block differs: the first still hits, the walk stops at the second.
    half = make_request("g", [0, 1, 2, 3, 9, 9, 9, 9, 9])
    half.block_hashes = list(a.block_hashes)
    hits, num_hit = kv.get_computed_blocks(half)
    assert hit_ids(hits) == [1] and num_hit == 4


def test_allocate_none_changes_nothing():
    kv = KVCacheManager(BS, num_blocks=5)  # 4 usable blocks
    a = make_request("a", list(range(12)))
    admit(kv, a)  # [1, 2, 3]
    kv.free(a)
    before = (free_ids(kv), kv.block_pool.num_cached_blocks, kv.prefix_cache_queries)
    # 17 tokens: 3 hit blocks (all in the free queue) + 2 new blocks, but only 4 exist.
    b = make_request("b", list(range(12)) + [40, 41, 42, 43, 44])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is None
    assert (free_ids(kv), kv.block_pool.num_cached_blocks, kv.prefix_cache_queries) == before
    assert refs(kv, [1, 2, 3, 4]) == [0, 0, 0, 0] and table(kv, b) == []
    # 16 tokens need exactly one new block: it fits, reusing the three hits.
    c = make_request("c", list(range(12)) + [40, 41, 42, 43])
    hits, num_hit = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens - num_hit, hits) is not None
    assert table(kv, c) == [1, 2, 3, 4] and kv.get_num_free_blocks() == 0


def test_allocate_grows_block_table_only_when_a_block_fills():
    kv = KVCacheManager(BS, num_blocks=10)
    req = make_request("a", [1, 2, 3])
    assert [b.block_id for b in kv.allocate_slots(req, 3)[0]] == [1]
    req.num_computed_tokens = 3
    assert kv.allocate_slots(req, 1) == ([],)  # slot 3 of block 1
    req.num_computed_tokens = 4
    assert [b.block_id for b in kv.allocate_slots(req, 5)[0]] == [2, 3]
    assert table(kv, req) == [1, 2, 3]


def test_reset_prefix_cache():
    kv = KVCacheManager(BS, num_blocks=10)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
    kv.free(a)
    assert kv.get_num_free_blocks() == 9


def test_caching_disabled():
    kv = KVCacheManager(BS, num_blocks=10, enable_caching=False)
    admit(kv, make_request("a", list(range(9))))
    b = make_request("b", list(range(9)))
    assert kv.get_computed_blocks(b)[1] == 0
    assert admit(kv, b) == [4, 5, 6]
    assert kv.prefix_cache_queries == 0 and kv.block_pool.num_cached_blocks == 0
