"""A chi-square goodness-of-fit check without scipy (sampling tests)."""

from __future__ import annotations

import math

import mlx.core as mx
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


def assert_second_tokens_fit(llm, oracle, prompt: list[int], temperature: float, num_samples: int):
    """Sample ``num_samples`` 3-token continuations of ``prompt`` with ``llm`` (speculating
    one draft, so every 2nd token is drafted and verified) and check the first two tokens
    against the target's distribution from ``oracle`` (mlx-lm): P(t1), and P(t2) = sum
    over t1 of P(t1) P(t2 | t1). Returns the engine's stats (acceptance counts)."""
    from mlxserve import SamplingParams

    def softmax(logits: mx.array) -> np.ndarray:
        x = np.array(logits.astype(mx.float32)) / temperature
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p1 = softmax(oracle(mx.array([prompt]))[0, -1])  # (V,)
    vocab = p1.shape[-1]
    p2 = softmax(oracle(mx.array([prompt + [t] for t in range(vocab)]))[:, -1])  # (V, V)
    # max_tokens 3: the 2nd token is drafted (the 3rd is the bonus token).
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    outs = llm.generate([prompt] * num_samples, params, use_tqdm=False)
    first = np.array([o.outputs[0].token_ids[0] for o in outs])
    second = np.array([o.outputs[0].token_ids[1] for o in outs])
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens == num_samples  # every 2nd token was drafted
    # Drafts replaced many times (the resampling path ran).
    assert stats.spec_decode_num_draft_tokens - stats.spec_decode_num_accepted_tokens > 150
    assert_fits(np.bincount(first, minlength=vocab), p1)
    assert_fits(np.bincount(second, minlength=vocab), p1 @ p2)
    return stats
