"""A chi-square goodness-of-fit check without scipy (sampling tests)."""

from __future__ import annotations

import math

import numpy as np

Z_999 = 3.0902  # the standard normal's 0.999 quantile


def chi_square_critical(df: int, z: float = Z_999) -> float:
    """The chi-square quantile at the normal quantile z (Wilson-Hilferty: (X/df)^(1/3) is
    close to normal with mean 1 - 2/(9 df) and variance 2/(9 df)); within 2% of the
    tables for df >= 3."""
    v = 2.0 / (9.0 * df)
    return df * (1.0 - v + z * math.sqrt(v)) ** 3


def chi_square(
    counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0
) -> tuple[float, int]:
    """(statistic, degrees of freedom) of observed counts against probabilities; categories
    expected fewer than min_expected times are pooled into one."""
    counts = np.asarray(counts, dtype=np.float64)
    expected = np.asarray(probs, dtype=np.float64) * counts.sum()
    big = expected >= min_expected
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big).any():
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    obs_a, exp_a = np.array(obs), np.array(exp)
    keep = exp_a > 0
    assert obs_a[~keep].sum() == 0, "counts where the distribution has no mass"
    stat = float((((obs_a - exp_a) ** 2)[keep] / exp_a[keep]).sum())
    return stat, int(keep.sum()) - 1


def assert_fits(counts: np.ndarray, probs: np.ndarray) -> None:
    """Fail when counts are unlikely (p < 0.001) under probs."""
    stat, df = chi_square(counts, probs)
    assert df >= 1, "too few categories to test"
    limit = chi_square_critical(df)
    assert stat < limit, f"chi-square {stat:.1f} >= {limit:.1f} (df {df}): not distributed as p"
