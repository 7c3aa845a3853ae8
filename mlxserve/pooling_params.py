"""PoolingParams: how one embedding request turns hidden states into a vector (vLLM's name).

The pooling method itself (the last token's hidden state, or the mean over the prompt) is
the model's, read from its files (loader/pooling.py); a request chooses only the vector's
length (``dimensions``, for Matryoshka models) and whether it is scaled to unit norm.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxserve.exceptions import ParameterError

POOLING_METHODS = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """Per-request embedding settings, validated at construction."""

    dimensions: int | None = None  # keep the first `dimensions` values (then normalize)
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise ParameterError(
                f"dimensions must be an integer >= 1, got {self.dimensions!r}",
                parameter="dimensions",
            )
