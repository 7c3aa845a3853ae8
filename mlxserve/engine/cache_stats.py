"""What the prefix cache holds and how often it is hit, for `GET /cache/stats` and `/metrics`.

The engine's one tier today is the KV pool in memory ("pool"); a block there is either in
use by a running request, or free and still registered in the prefix cache (a later prompt
with the same prefix takes it back), or free and empty.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CacheTier:
    """One place blocks are kept."""

    name: str
    num_blocks: int  # usable blocks (the pool's null block left out)
    num_blocks_in_use: int  # held by running requests
    num_cached_blocks: int  # registered in the prefix cache (in use or free)
    bytes_per_block: int  # of every layer's K and V together

    @property
    def cached_bytes(self) -> int:
        return self.num_cached_blocks * self.bytes_per_block


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
        out = asdict(self)
        for tier, fields in zip(self.tiers, out["tiers"], strict=True):
            fields["cached_bytes"] = tier.cached_bytes
        return out | {"hit_rate": self.hit_rate}
