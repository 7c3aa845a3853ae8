"""KV cache specs and groups: layouts, window release, windowed and recurrent prefix hits,
state slots and snapshots. Exact block ids and hand-computed sizes."""

from __future__ import annotations

import mlx.core as mx

from mlxserve.core.kv_cache_manager import KVCacheManager
from mlxserve.core.request import Request
from mlxserve.core.state_pool import StatePool
from mlxserve.kv_cache_spec import (
    FULL_ATTENTION,
    RECURRENT,
    SLIDING_WINDOW,
    KVCacheGroupSpec,
    LayerCacheSpec,
    make_layout,
)
from mlxserve.sampling_params import SamplingParams

BS = 4
FULL = LayerCacheSpec(FULL_ATTENTION, 2, 16, 16)
WIN8 = LayerCacheSpec(SLIDING_WINDOW, 2, 16, 16, window=8)
# A gated delta net's state: conv (3, 96) and recurrent (2, 16, 16), float32.
GDN = LayerCacheSpec(
    RECURRENT, state_shapes=((3, 96), (2, 16, 16)), state_dtypes=("float32", "float32")
)


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


# ---- layouts ---------------------------------------------------------------------------------
def test_alternating_windows_share_tensors() -> None:
    """gpt-oss: (window, full) x 2 -> two groups of two layers on two shared tensors."""
    layout = make_layout([WIN8, FULL, WIN8, FULL])
    assert [(g.window, g.layers) for g in layout.groups] == [(8, (0, 2)), (None, (1, 3))]
    assert layout.layer_groups == (0, 1, 0, 1) and layout.layer_tensors == (0, 0, 1, 1)
    # 2 tensors x 4 tokens x 2 heads x (16 + 16) dims x 2 bytes: half of 4 layers' pools.
    assert layout.bytes_per_block(BS, mx.float16) == 2 * 4 * 2 * 32 * 2 == 1024
    # 100 tokens, 16-token chunks: full 25 blocks; window ceil((8 - 1 + 16) / 4) + 1 = 7.
    assert layout.blocks_per_request(100, BS, 16) == 25 + 7
    assert layout.reason is None and not layout.has_state


def test_different_shapes_make_one_group_with_a_reason() -> None:
    """Gemma 4: global layers have larger heads -> one group, a tensor per layer, windowed
    layers keep their blocks (and the log says so)."""
    big = LayerCacheSpec(FULL_ATTENTION, 2, 32, 32)
    layout = make_layout([WIN8, big, WIN8])
    assert [(g.window, g.layers) for g in layout.groups] == [(None, (0, 1, 2))]
    assert layout.tensor_shapes == ((2, 16, 16), (2, 32, 32), (2, 16, 16))
    assert "sliding-window blocks are kept" in layout.reason
    assert layout.bytes_per_block(BS, mx.float32) == 4 * 2 * (32 + 64 + 32) * 4


def test_recurrent_layers_take_state_slots_not_blocks() -> None:
    layout = make_layout([GDN, GDN, GDN, FULL])
    assert [g.layers for g in layout.groups] == [(3,)]
    assert layout.layer_groups == (-1, -1, -1, 0) and layout.state_layers == (0, 1, 2)
    assert GDN.state_bytes() == (3 * 96 + 2 * 16 * 16) * 4 == 3200
    assert layout.state_bytes_per_slot() == 3 * 3200
    assert layout.bytes_per_block(BS, mx.float16) == 4 * 2 * 32 * 2  # one tensor
    assert "3 recurrent layer(s) in state slots" in layout.describe()


# ---- sliding windows release their blocks ------------------------------------------------------
GROUPS = (KVCacheGroupSpec(FULL_ATTENTION, None, ()), KVCacheGroupSpec(SLIDING_WINDOW, 8, ()))


def test_window_releases_blocks_behind_it_and_a_hit_needs_only_the_window() -> None:
    kv = KVCacheManager(BS, num_blocks=20, groups=GROUPS)
    a = make_request("a", list(range(14)))
    hit, n = kv.get_computed_blocks(a)
    assert n == 0 and kv.allocate_slots(a, 14, hit) is not None
    a.num_computed_tokens = 14
    kv.cache_blocks(a, 14)
    assert kv.get_block_ids(a) == ([1, 2, 3, 4], [5, 6, 7, 8])
    # The next token (position 14) sees 7..14: block 0 (tokens 0..3) of the window group
    # goes back to the pool (its hash stays cached), the full group keeps everything.
    a.output_token_ids.append(99)
    assert kv.allocate_slots(a, 1) == ([], [])
    assert kv.get_block_ids(a) == ([1, 2, 3, 4], [0, 6, 7, 8])
    assert kv.block_pool.blocks[5].ref_cnt == 0 and kv.get_num_free_blocks() == 20 - 1 - 7
    # A request sharing 12 tokens resumes at 12 in both groups; in the window group it
    # needs blocks 1 and 2 only (its next token, 12, sees 5..12).
    b = make_request("b", list(range(12)) + [50, 51, 52])
    hit, n = kv.get_computed_blocks(b)
    assert n == 12 and hit.block_ids() == ([1, 2, 3], [0, 6, 7])
    assert kv.allocate_slots(b, 3, hit) is not None
    assert kv.get_block_ids(b) == ([1, 2, 3, 9], [0, 6, 7, 10])
    kv.free(a)
    kv.free(b)
    assert kv.get_num_free_blocks() == 19


def test_a_prompt_longer_than_the_window_in_one_step_keeps_its_blocks_cached() -> None:
    """Async scheduling allocates the next step before the last one's blocks are registered:
    a 14-token prompt computed in one step, window 8, then its first decode step scheduled
    before cache_blocks. Block 0 (tokens 0..3) left the window, but it must stay held
    until it is registered; then it goes back to the pool with its hash, and a prompt
    sharing 12 tokens hits 12 in both groups (the window group needs blocks 1 and 2)."""
    kv = KVCacheManager(BS, num_blocks=20, groups=GROUPS)
    a = make_request("a", list(range(14)))
    assert kv.allocate_slots(a, 14, kv.get_computed_blocks(a)[0]) is not None
    a.num_computed_tokens = 14  # the step is scheduled; its output not processed yet
    a.output_token_ids.append(99)
    assert kv.allocate_slots(a, 1) == ([], [])
    assert kv.get_block_ids(a) == ([1, 2, 3, 4], [5, 6, 7, 8])  # block 0 not yet registered
    kv.cache_blocks(a, 14)
    a.num_computed_tokens = 15
    assert kv.allocate_slots(a, 1) == ([], [])
    # Token 15 sees 8..15: blocks 0 and 1 released, still cached.
    assert kv.get_block_ids(a) == ([1, 2, 3, 4], [0, 0, 7, 8])
    kv.free(a)
    hit, n = kv.get_computed_blocks(make_request("b", list(range(12)) + [50, 51, 52]))
    assert n == 12 and hit.block_ids() == ([1, 2, 3], [0, 6, 7])


def test_window_hit_is_cut_where_the_window_lost_a_block() -> None:
    """The full group has all 3 blocks cached; the window group lost block 2 (evicted), so
    its longest resumable prefix is 2 blocks, and the hit shrinks to 8 tokens in both
    (token 8 sees 1..8: the window group needs both blocks)."""
    kv = KVCacheManager(BS, num_blocks=20, groups=GROUPS)
    a = make_request("a", list(range(13)))
    kv.allocate_slots(a, 13, kv.get_computed_blocks(a)[0])
    a.num_computed_tokens = 13
    kv.cache_blocks(a, 13)
    kv.free(a)
    window_block_2 = kv.managers[1].key(a.block_hashes[2])
    kv.block_pool._evict(kv.block_pool.cached_block_hash_to_block[window_block_2])
    hit, n = kv.get_computed_blocks(make_request("b", list(range(13))))
    assert n == 8 and hit.block_ids() == ([1, 2], [5, 6])


def test_every_group_takes_its_hits_before_any_takes_new_blocks() -> None:
    """Regression: b's full-attention hit (block 3) sat in the free queue right behind the
    blocks the window group allocated first, so it was handed out as the window group's
    new block while the full group shared it: one block in two groups' tables, wrong
    tokens after a preemption (gemma3_text, gpt_oss in the engine)."""
    kv = KVCacheManager(BS, num_blocks=9, groups=GROUPS)
    a, c = make_request("a", list(range(8))), make_request("c", list(range(100, 108)))
    for req in (a, c):
        kv.allocate_slots(req, 8)
        req.num_computed_tokens = 8
        kv.cache_blocks(req, 8)
    assert kv.get_block_ids(a) == ([1, 2], [3, 4]) and kv.get_block_ids(c) == ([5, 6], [7, 8])
    kv.free(a)
    kv.free(c)  # free queue: 2 1 4 3 6 5 8 7
    b = make_request("b", list(range(4)) + list(range(50, 62)))
    hit, n = kv.get_computed_blocks(b)
    assert n == 4 and hit.block_ids() == ([1], [3])
    assert kv.allocate_slots(b, 12, hit) is not None
    assert kv.get_block_ids(b) == ([1, 2, 4, 6], [3, 5, 8, 7])


# ---- recurrent state: slots and snapshots ------------------------------------------------------
def test_prompt_end_snapshot_in_an_earlier_chunk() -> None:
    """An 18-token prompt in chunks of 8: its last full block ends at 16, the end of the
    second chunk (not the last): the state there is snapshotted, and a request repeating
    the prompt resumes from it."""
    kv = KVCacheManager(BS, num_blocks=20, num_state_slots=6)
    a = make_request("a", list(range(18)))
    slots = []
    for chunk in (8, 8, 2):
        hit, _ = kv.get_computed_blocks(a) if not slots else (None, 0)
        assert kv.allocate_slots(a, chunk, hit) is not None
        slots.append(kv.get_state_slots(a))
        a.num_computed_tokens += chunk
        kv.cache_blocks(a, a.num_computed_tokens)
    live = slots[0].write
    assert [(s.read, s.write) for s in slots] == [(0, live), (live, live), (live, live)]
    assert slots[0].snapshots == () and slots[2].snapshots == ()
    ((position, snapshot),) = slots[1].snapshots
    assert position == 16 and snapshot not in (0, live)
    b = make_request("b", list(range(18)))
    hit, n = kv.get_computed_blocks(b)
    assert n == 16 and hit.state_slot == snapshot
    assert kv.allocate_slots(b, 2, hit) is not None
    assert kv.get_state_slots(b).read == snapshot  # b starts from a's state after 16 tokens


def test_state_pool_tail_snapshots_replace_each_other_and_lru_eviction() -> None:
    pool = StatePool(num_slots=4)  # the null slot and 3
    assert pool.allocate_live("a") == 1
    s2 = pool.take_snapshot("a", b"h8", 8, is_tail=True)
    pool.commit("a", 8)
    assert pool.lookup(b"h8") == s2 == 2
    s3 = pool.take_snapshot("a", b"h12", 12, is_tail=True)
    pool.commit("a", 12)
    # The newer tail replaced the older one, whose slot is free again.
    assert pool.lookup(b"h8") is None and pool.lookup(b"h12") == s3 == 3
    assert pool.num_available() == 2  # slot 2 free, slot 3 evictable
    assert pool.allocate_live("b") == 2
    pool.start_reading("c", 3)  # c's first step reads the snapshot: it may not be evicted
    assert pool.num_available() == 0 and pool.allocate_live("d") is None
    pool.commit("c", 4)
    assert pool.num_available() == 1
    assert pool.allocate_live("d") == 3 and pool.lookup(b"h12") is None  # evicted
    for rid in "abd":
        pool.free(rid)
    assert pool.num_available() == 3 and pool.num_snapshots == 0


def test_admission_never_evicts_the_snapshot_it_reads() -> None:
    """The snapshot a new request resumes from is the oldest evictable one and no slot is
    free: the request's own slot must come from another snapshot, never the one it reads
    (found by the hybrid scheduler property test: two requests wrote one slot)."""
    kv = KVCacheManager(BS, num_blocks=20, num_state_slots=4)  # the null slot and 3

    def run(rid: str, tokens: list[int]) -> Request:
        r = make_request(rid, tokens)
        hit, n = kv.get_computed_blocks(r)
        assert kv.allocate_slots(r, len(tokens) - n, hit) is not None
        r.num_computed_tokens = len(tokens)
        kv.cache_blocks(r, len(tokens))
        return r

    kv.free(run("a", list(range(9))))  # snapshot after 8 tokens: the oldest
    kv.free(run("d", list(range(50, 59))))  # another snapshot
    run("c", [90, 91, 92])  # holds the last free slot
    b = make_request("b", list(range(9)))
    hit, n = kv.get_computed_blocks(b)
    assert n == 8 and hit.state_slot
    assert kv.allocate_slots(b, 1, hit) is not None
    slots = kv.get_state_slots(b)
    assert slots.read == hit.state_slot and slots.write not in (0, slots.read)
    assert kv.state_pool.lookup(b.block_hashes[1]) == slots.read  # still registered


def test_a_new_tail_only_drops_its_own_old_tail() -> None:
    """A request's old tail snapshot was evicted and its slot now holds another request's
    snapshot: the new tail must not drop that one."""
    pool = StatePool(num_slots=4)
    assert pool.allocate_live("a") == 1
    assert pool.take_snapshot("a", b"a8", 8, is_tail=True) == 2
    pool.commit("a", 8)
    assert pool.allocate_live("b") == 3
    assert pool.take_snapshot("b", b"b4", 4, is_tail=False) == 2  # evicts a's tail
    pool.commit("b", 4)
    pool.free("b")
    assert pool.take_snapshot("a", b"a12", 12, is_tail=True) == 3
    pool.commit("a", 12)
    assert pool.lookup(b"b4") == 2 and pool.lookup(b"a12") == 3
