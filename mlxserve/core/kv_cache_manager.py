"""KVCacheManager: the scheduler's only window into KV memory (blocks, prefix hits, frees).

It coordinates one GroupManager per KV cache group (core/kv_cache_groups.py: full
attention, sliding windows; mlxserve/kv_cache_spec.py says how a model's layers are
grouped) over one shared BlockPool, and the StatePool of recurrent layers (slots and prefix
snapshots, core/state_pool.py). A prefix hit must be valid for every group and for the
state at once (see get_computed_blocks).

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
from dataclasses import dataclass
from typing import Protocol

from mlxserve.core.block_pool import BlockHash, BlockPool, KVCacheBlock
from mlxserve.core.kv_cache_groups import GroupManager
from mlxserve.core.request import Request
from mlxserve.core.state_pool import StatePool
from mlxserve.kv_cache_spec import FULL_ATTENTION, KVCacheGroupSpec

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


@dataclass
class CachedPrefix:
    """A prefix-cache hit: per group, the blocks to share (null where a window does not
    need them), the tokens they hold, and the snapshot slot of the recurrent state after
    those tokens (0: none, i.e. no hit or no recurrent layers)."""

    blocks: tuple[list[KVCacheBlock], ...]
    num_tokens: int = 0
    state_slot: int = 0

    def block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in blocks] for blocks in self.blocks)


@dataclass(frozen=True, slots=True)
class StateSlots:
    """A request's recurrent state in one step: read from slot ``read`` (0: zeros), write
    the result to ``write``; ``snapshots`` are (position, slot): also write the state after
    ``position`` tokens into ``slot``."""

    read: int
    write: int
    snapshots: tuple[tuple[int, int], ...] = ()


FULL_GROUP = (KVCacheGroupSpec(FULL_ATTENTION, None, ()),)


class BlockStore(Protocol):
    """Where full blocks are kept beyond the pool (the engine's disk tier)."""

    def load(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> object | None:
        """The block's K/V if it is kept for exactly these tokens (None: compute it)."""


class KVCacheManager:
    """Allocates blocks (and state slots) per request, finds cached prefixes, frees them.

    Prefix-cache stats are cumulative counters, counted in tokens at a request's first
    admission (not on retries, not on resumption after preemption):
    ``prefix_cache_queries`` (tokens looked up) and ``prefix_cache_hits`` (tokens found);
    ``prefix_cache_requests`` and ``prefix_cache_requests_hit`` count the requests.

    ``groups``: the model's KV cache groups (default: one full-attention group).
    ``num_state_slots``: recurrent-state slots including the null slot (0: no recurrent
    layers). ``snapshot_interval``: also snapshot the state every that many tokens (a
    multiple of block_size; 0: only at the end of each prompt and while decoding).
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool = True,
        initial_blocks: int | None = None,
        *,
        groups: Sequence[KVCacheGroupSpec] = FULL_GROUP,
        num_state_slots: int = 0,
        snapshot_interval: int = 0,
    ) -> None:
        assert block_size >= 1, block_size  # EngineConfig checks it
        assert snapshot_interval % block_size == 0, (snapshot_interval, block_size)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, initial_blocks)
        self.groups = tuple(groups)
        self.managers = tuple(
            GroupManager(spec, i, self.block_pool, block_size, len(self.groups) > 1, enable_caching)
            for i, spec in enumerate(self.groups)
        )
        self.state_pool = StatePool(num_state_slots) if num_state_slots else None
        self.snapshot_interval = snapshot_interval
        self._step_state: dict[str, StateSlots] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_requests = 0
        self.prefix_cache_requests_hit = 0
        self.prefix_cache_hits_stored = 0  # of prefix_cache_hits, tokens loaded from store
        # Full blocks kept beyond the pool (set by the engine for one full-attention group
        # without recurrent state; None: no such tier).
        self.store: BlockStore | None = None
        # The blocks last read for a request still waiting for room: (request id, first
        # block, blocks), so a head of the queue that does not fit yet is read once, not
        # at every step it waits.
        self._stored_read: tuple[str, int, list[object]] | None = None
        # A hit stops a block short (MTP: the scheduler sets it).
        self.drop_last_hit_block = False

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

    def max_request_tokens(self, max_chunk_tokens: int) -> int | None:
        """Most tokens one request can hold alone in the pool, when at most
        ``max_chunk_tokens`` are computed per step (None: any number, windows only)."""
        usable, bs = self.num_usable_blocks, self.block_size

        def need(n: int) -> int:
            return sum(g.blocks_needed(n, bs, max_chunk_tokens) for g in self.groups)

        if all(g.window is not None for g in self.groups):
            bound = need(1 << 40)
            if bound <= usable:
                return None
        low, high = 0, usable * bs  # need(low) fits, need(high + 1) does not
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if need(mid) <= usable else (low, mid - 1)
        return low

    def _use_prefix_cache(self, request: Request) -> bool:
        # Prompt logprobs need logits for every prompt token, and a mean-pooled embedding
        # every prompt token's hidden state, so nothing may be skipped.
        return (
            self.enable_caching
            and request.sampling_params.prompt_logprobs is None
            and request.pooling != "mean"
        )

    def update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), request.num_tokens // bs):
            extra = (request.cache_salt,) if i == 0 and request.cache_salt else None
            parent = hash_block_tokens(parent, request.get_token_ids(i * bs, (i + 1) * bs), extra)
            hashes.append(parent)

    def _empty(self) -> CachedPrefix:
        return CachedPrefix(tuple([] for _ in self.managers))

    def get_computed_blocks(self, request: Request) -> tuple[CachedPrefix, int]:
        """The longest cached prefix of the request: (the hit, number of tokens it holds).

        Never the whole sequence: at least its last token is left to compute, so the
        model produces logits for the next one. Every group and the recurrent state must
        resume at the same length: each is asked for its longest hit up to the current
        length, which shrinks to their minimum until all agree (a fixed point; lengths
        only decrease).
        """
        if not self._use_prefix_cache(request):
            return self._empty(), 0
        self.update_block_hashes(request)
        bs = self.block_size
        hashes = request.block_hashes

        def token_ids(i: int) -> list[int]:
            return request.get_token_ids(i * bs, (i + 1) * bs)

        num_blocks = (request.num_tokens - 1) // bs
        dropped = not self.drop_last_hit_block
        while True:
            hits = [m.find_longest_cache_hit(hashes, token_ids, num_blocks) for m in self.managers]
            state_slot, state_blocks = self._find_snapshot(hashes, num_blocks)
            agreed = min([len(h) for h in hits] + [state_blocks])
            if agreed == num_blocks and (dropped or num_blocks == 0):
                break
            if agreed == num_blocks:  # once agreed, one block less
                agreed, dropped = num_blocks - 1, True
            num_blocks = agreed
        if num_blocks == 0:
            return self._empty(), 0
        return CachedPrefix(tuple(hits), num_blocks * bs, state_slot), num_blocks * bs

    def load_stored_blocks(self, request: Request, num_hit_tokens: int) -> list[object]:
        """The blocks right after a pool hit of ``num_hit_tokens`` that the store keeps,
        consecutive, read now (the request's last token always left to compute)."""
        bs = self.block_size
        if self.store is None or self.drop_last_hit_block or not self._use_prefix_cache(request):
            return []
        first = num_hit_tokens // bs
        read = self._stored_read
        if read is not None and read[:2] == (request.request_id, first):
            return read[2]
        self.update_block_hashes(request)
        found: list[object] = []
        for i in range(first, (request.num_tokens - 1) // bs):
            token_ids = tuple(request.get_token_ids(i * bs, (i + 1) * bs))
            block = self.store.load(request.block_hashes[i], token_ids)
            if block is None:
                break
            found.append(block)
        self._stored_read = (request.request_id, first, found) if found else None
        return found

    def _find_snapshot(self, hashes: Sequence[BlockHash], max_blocks: int) -> tuple[int, int]:
        """(slot, blocks) of the longest snapshot of at most max_blocks blocks; with no
        recurrent layers any length is fine."""
        if self.state_pool is None:
            return 0, max_blocks
        for n in range(max_blocks, 0, -1):
            slot = self.state_pool.lookup(hashes[n - 1])
            if slot is not None:
                return slot, n
        return 0, 0

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        cached: CachedPrefix | None = None,
        num_stored_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...] | None:
        """Make room for num_new_tokens more tokens; return the newly allocated blocks
        (per group).

        ``cached`` is the hit from get_computed_blocks (only at admission); its blocks are
        shared (ref_cnt + 1), not copied. ``num_stored_tokens`` (at admission, counted in
        ``num_new_tokens``): the first new blocks are filled from the store, not computed.
        Blocks a window no longer needs are released first. Returns None, changing nothing
        else (but those releases), when the free blocks (or, for recurrent layers, a state
        slot at admission) do not suffice.
        """
        assert num_new_tokens >= 1, num_new_tokens
        rid = request.request_id
        cached = cached or self._empty()
        is_first_allocation = rid not in self._live_requests()
        assert is_first_allocation or not cached.num_tokens, "cache hits only at admission"
        num_computed = request.num_computed_tokens + cached.num_tokens
        if not is_first_allocation:
            for m in self.managers:
                m.remove_skipped_blocks(rid, request.num_computed_tokens)
        total = num_computed + num_new_tokens
        num_new_blocks = sum(
            m.num_blocks_to_allocate(rid, total, hit)
            for m, hit in zip(self.managers, cached.blocks, strict=True)
        )
        # Hits sitting in the free queue stop being free once touched.
        null = self.block_pool.null_block
        num_free_hits = sum(
            1 for hit in cached.blocks for b in hit if b is not null and b.ref_cnt == 0
        )
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
            # Out-of-window blocks held until registered go first, cache or not.
            released = (
                0
                if is_first_allocation
                else sum(
                    m.remove_skipped_blocks(rid, request.num_computed_tokens, unregistered_too=True)
                    for m in self.managers
                )
            )
            return self.allocate_slots(request, num_new_tokens) if released else None
        states = self.state_pool
        if states is not None and is_first_allocation:
            pinned = 1 if cached.state_slot and states.is_evictable(cached.state_slot) else 0
            if states.num_available() - pinned < 1:
                return None

        if is_first_allocation and self._use_prefix_cache(request) and not request.num_preemptions:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += cached.num_tokens + num_stored_tokens
            self.prefix_cache_hits_stored += num_stored_tokens
            self.prefix_cache_requests += 1
            self.prefix_cache_requests_hit += cached.num_tokens + num_stored_tokens > 0
        if is_first_allocation:
            if self._stored_read is not None and self._stored_read[0] == rid:
                self._stored_read = None  # admitted: its blocks go into the pool now
            for m, hit in zip(self.managers, cached.blocks, strict=True):
                m.take_hits(rid, hit)
        new = tuple(m.allocate(rid, total) for m in self.managers)
        if states is not None:
            self._allocate_state(request, num_computed, num_new_tokens, cached, is_first_allocation)
        return new

    def _live_requests(self) -> dict[str, object]:
        if self.managers:
            return self.managers[0].req_to_blocks
        assert self.state_pool is not None
        return self.state_pool.live

    def _allocate_state(
        self,
        request: Request,
        num_computed: int,
        num_new_tokens: int,
        cached: CachedPrefix,
        is_first_allocation: bool,
    ) -> None:
        """The request's state slots for this step, and the snapshots it takes."""
        states = self.state_pool
        assert states is not None
        rid = request.request_id
        if is_first_allocation:
            read = cached.state_slot
            if read:  # pinned first: taking the live slot may not evict it
                states.start_reading(rid, read)
            live = states.allocate_live(rid)
            assert live is not None  # checked by allocate_slots
        else:
            live = read = states.live[rid]
        snapshots = []
        if self._use_prefix_cache(request):
            self.update_block_hashes(request)
            for position, is_tail in self._snapshot_positions(
                request, num_computed, num_new_tokens
            ):
                block_hash = request.block_hashes[position // self.block_size - 1]
                slot = states.take_snapshot(rid, block_hash, position, is_tail)
                if slot is not None:
                    snapshots.append((position, slot))
        self._step_state[rid] = StateSlots(read, live, tuple(snapshots))

    def _snapshot_positions(
        self, request: Request, start: int, num_new_tokens: int
    ) -> list[tuple[int, bool]]:
        """Block boundaries in (start, start + num_new_tokens] to snapshot: multiples of
        snapshot_interval, and the request's last full-block boundary (its prompt's, or
        while decoding a "tail": each replaces the previous one). That boundary may fall
        in an earlier chunk than the last: a 33-token prompt in chunks of 16 snapshots at
        32 in its second chunk."""
        end = start + num_new_tokens
        out = []
        if self.snapshot_interval:
            step = self.snapshot_interval
            out = [(p, False) for p in range((start // step + 1) * step, end + 1, step)]
        last = request.num_tokens // self.block_size * self.block_size
        if start < last <= end and (not out or out[-1][0] != last):
            is_decode = num_new_tokens == 1 and start >= request.num_prompt_tokens
            out.append((last, is_decode))
        return out

    def get_state_slots(self, request: Request) -> StateSlots | None:
        """The request's state slots for the step just allocated (None: no recurrent layers)."""
        return self._step_state.get(request.request_id)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """The request's step is done: register its blocks made full by its first
        num_computed_tokens tokens, and its snapshots."""
        if self.state_pool is not None:
            self.state_pool.commit(request.request_id, num_computed_tokens)
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        for m in self.managers:
            m.cache_blocks(request, num_computed_tokens)

    def free_excess_blocks(self, request: Request) -> None:
        """Release blocks past the request's computed tokens (after rejected drafts)."""
        for m in self.managers:
            m.free_excess_blocks(request.request_id, request.num_computed_tokens)

    def free(self, request: Request) -> None:
        """Release the request's blocks (last block first, so its prefix is evicted last)
        and its state slot."""
        for m in self.managers:
            m.free(request.request_id)
        if self.state_pool is not None:
            self.state_pool.free(request.request_id)
        self._step_state.pop(request.request_id, None)
        if self._stored_read is not None and self._stored_read[0] == request.request_id:
            self._stored_read = None  # aborted while it waited

    def get_block_ids(self, request: Request) -> tuple[list[int], ...]:
        """The request's block table in each group, as block ids (fresh lists)."""
        return tuple(m.block_ids(request.request_id) for m in self.managers)

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes (e.g. after loading new weights)."""
        self.block_pool.reset_prefix_cache()
        if self.state_pool is not None:
            self.state_pool.reset()
