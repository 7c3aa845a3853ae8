"""Engine bookkeeping, no arrays: requests, block pool, KV cache manager, scheduler."""
