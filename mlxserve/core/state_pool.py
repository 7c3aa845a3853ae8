"""StatePool: recurrent-state slots (one per running request) and prefix snapshots.

A recurrent layer (gated delta net, SSM) keeps a fixed-size state per request instead of
per-token K/V. The runner holds, per recurrent layer, arrays of ``num_slots`` states; this
pool hands out slot indices. Slot 0 is the null slot: it always holds zeros (the state of
an empty prefix) and is never written.

Prefix caching cannot rebuild a recurrent state from cached blocks, so the state itself is
kept at some block boundaries (snapshots), keyed by the chained hash of the blocks before
it. A snapshot is written during the step that computes its position, and registered
(visible to prefix lookups) only once that step is done::

    schedule: take_snapshot(request, hash, position) -> slot     (pending)
    step:     the runner writes the state after `position` tokens into the slot
    update:   commit(request, num_computed) registers it          (hits may use it)

Unreferenced snapshots are evicted least recently used first when a slot is needed. A
request's "tail" snapshot (taken while decoding) is replaced by its next one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from mlxserve.core.block_pool import BlockHash


@dataclass(slots=True)
class _Pending:
    block_hash: BlockHash
    slot: int
    position: int  # tokens the snapshot's state has seen
    is_tail: bool


class StatePool:
    """Slot allocation, snapshot lookup/registration and LRU eviction (no arrays here)."""

    def __init__(self, num_slots: int, initial_slots: int | None = None) -> None:
        assert num_slots >= 2, num_slots  # the null slot and one usable slot
        self.num_slots = num_slots
        self.num_allocated_slots = max(2, min(initial_slots or num_slots, num_slots))
        self._free: list[int] = list(range(self.num_allocated_slots - 1, 0, -1))  # pop: lowest
        self.live: dict[str, int] = {}
        self._snapshots: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._refs: dict[int, int] = {}  # snapshot slot -> requests about to read it
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable snapshots, oldest first
        self._pending: dict[str, list[_Pending]] = {}
        # request -> its registered tail snapshot (slot, hash); the slot may have been
        # evicted and reused since, so the hash tells whether it is still that snapshot.
        self._tail: dict[str, tuple[int, BlockHash]] = {}
        self._reading: dict[str, int] = {}  # request -> the snapshot its next step reads

    # ------------------------------------------------------------- slots
    def num_available(self) -> int:
        """Slots that can be handed out now (free, not yet grown, or evictable)."""
        return len(self._free) + self.num_slots - self.num_allocated_slots + len(self._lru)

    def _take(self) -> int | None:
        if not self._free and self.num_allocated_slots < self.num_slots:
            grown = min(self.num_slots, 2 * self.num_allocated_slots)
            self._free = list(range(grown - 1, self.num_allocated_slots - 1, -1))
            self.num_allocated_slots = grown
        if self._free:
            return self._free.pop()
        if self._lru:
            slot, _ = self._lru.popitem(last=False)
            self._forget(slot)
            return slot
        return None

    def _forget(self, slot: int) -> None:
        """Unregister a snapshot slot (its content is about to be overwritten)."""
        block_hash = self._hash_of.pop(slot)
        del self._snapshots[block_hash]

    def _release(self, slot: int) -> None:
        """Give a slot back: free now, or evictable if it is a registered snapshot."""
        if slot in self._hash_of:
            if not self._refs.get(slot):
                self._lru[slot] = None
                self._lru.move_to_end(slot)
        else:
            self._free.append(slot)

    def allocate_live(self, request_id: str) -> int | None:
        """The request's own state slot (None: no slot can be freed now)."""
        assert request_id not in self.live, request_id
        slot = self._take()
        if slot is not None:
            self.live[request_id] = slot
        return slot

    # ------------------------------------------------------------- snapshots
    def lookup(self, block_hash: BlockHash) -> int | None:
        """The registered snapshot slot for a prefix, or None."""
        return self._snapshots.get(block_hash)

    def is_evictable(self, slot: int) -> bool:
        """True for a registered snapshot nobody is about to read (counted as available)."""
        return slot in self._lru

    def start_reading(self, request_id: str, slot: int) -> None:
        """The request's first step starts from snapshot ``slot``: keep it until then."""
        self._refs[slot] = self._refs.get(slot, 0) + 1
        self._lru.pop(slot, None)
        self._reading[request_id] = slot

    def take_snapshot(
        self, request_id: str, block_hash: BlockHash, position: int, is_tail: bool
    ) -> int | None:
        """A slot for the state after ``position`` tokens (None: known already, or no
        slot free)."""
        if block_hash in self._snapshots:
            return None
        slot = self._take()
        if slot is not None:
            self._pending.setdefault(request_id, []).append(
                _Pending(block_hash, slot, position, is_tail)
            )
        return slot

    def commit(self, request_id: str, num_computed: int) -> None:
        """The request's step is done: register its snapshots up to ``num_computed`` tokens
        and release the snapshot it started from."""
        slot = self._reading.pop(request_id, None)
        if slot is not None:
            self._unref(slot)
        pending = self._pending.get(request_id)
        if not pending:
            return
        keep = [p for p in pending if p.position > num_computed]
        for p in pending:
            if p.position > num_computed:
                continue
            if p.block_hash in self._snapshots:  # another request registered it first
                self._free.append(p.slot)
                continue
            self._snapshots[p.block_hash] = p.slot
            self._hash_of[p.slot] = p.block_hash
            self._release(p.slot)
            if p.is_tail:
                old = self._tail.pop(request_id, None)
                if old is not None and self._hash_of.get(old[0]) == old[1] and old[0] in self._lru:
                    del self._lru[old[0]]  # unread: drop it
                    self._forget(old[0])
                    self._free.append(old[0])
                self._tail[request_id] = (p.slot, p.block_hash)
        if keep:
            self._pending[request_id] = keep
        else:
            del self._pending[request_id]

    def _unref(self, slot: int) -> None:
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            del self._refs[slot]
            self._release(slot)

    def free(self, request_id: str) -> None:
        """The request is done or preempted: its slot, unwritten snapshots and read pin go."""
        slot = self.live.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        for p in self._pending.pop(request_id, ()):
            self._free.append(p.slot)
        reading = self._reading.pop(request_id, None)
        if reading is not None:
            self._unref(reading)
        self._tail.pop(request_id, None)

    def reset(self) -> None:
        """Forget every registered snapshot (slots being read are freed when released)."""
        for slot in list(self._hash_of):
            self._forget(slot)
            if slot in self._lru:  # unread: free now; read ones are freed on release
                del self._lru[slot]
                self._free.append(slot)
        self._tail.clear()

    @property
    def num_snapshots(self) -> int:
        """Registered snapshots."""
        return len(self._snapshots)
