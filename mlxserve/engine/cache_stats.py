"""What the prefix cache holds and how often it is hit, for `GET /cache/stats` and `/metrics`.

Two tiers: the KV pool in memory ("pool"), where a block is in use by a running request,
or free and still registered in the prefix cache (a later prompt with the same prefix takes
it back), or free and empty; and, where it is on, the disk tier ("disk", engine/kv_disk.py),
where every block computed is kept in a file, across evictions and restarts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CacheTier:
    """One place blocks are kept."""

    name: str
    num_blocks: int  # blocks it can hold (the pool's null block left out)
    num_blocks_in_use: int  # held by running requests
    num_cached_blocks: int  # held for the prefix cache (in use or free)
    bytes_per_block: int  # of every layer's K and V together
    cached_bytes: int  # of the cached blocks (on disk: the files' sizes)
    hit_tokens: int  # prompt tokens found here since start


@dataclass(frozen=True)
class CacheStats:
    """The prefix cache's tiers and its cumulative counters since start. Queries and hits
    count prompt tokens at a request's first admission (vLLM's prefix_cache_queries /
    prefix_cache_hits), requests count requests."""

    enabled: bool
    block_size: int
    tiers: tuple[CacheTier, ...]
    query_tokens: int
    hit_tokens: int
    num_requests: int
    num_requests_hit: int

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens found (0 before any lookup)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {"hit_rate": self.hit_rate}
