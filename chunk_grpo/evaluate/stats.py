"""Confidence intervals for evaluation results."""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy import stats


def mean_ci95(values: torch.Tensor | np.ndarray) -> tuple[float, float]:
    """Mean and half-width of its 95% confidence interval (Student t; NaN for n < 2)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError("mean_ci95 needs at least one value")
    mean = float(x.mean())
    if x.size < 2:
        return mean, math.nan
    half = stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    return mean, float(half)


def best_of_k(rewards: torch.Tensor | np.ndarray, k: int) -> np.ndarray:
    """Per prompt, the expected best reward of k images drawn without replacement from its N.

    rewards: [P, N], the N images of each prompt. Uses every k-subset at once (order statistics:
    the i-th smallest of N is the best of a k-subset in C(i-1, k-1) of the C(N, k) subsets), so
    it is the unbiased estimate, less noisy than splitting the N images into groups of k.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [prompts, images per prompt], got shape {r.shape}")
    n = r.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..{n} (the images per prompt), got {k}")
    ranks = np.arange(1, n + 1)
    weights = np.array([math.comb(i - 1, k - 1) for i in ranks], dtype=np.float64)
    return np.sort(r, axis=1) @ (weights / math.comb(n, k))
