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
