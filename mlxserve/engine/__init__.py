"""The engine: requests in, steps scheduled and run, outputs detokenized (sync and async)."""
