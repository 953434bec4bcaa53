"""Per-sample scalars of one SDE step, so fused kernels only see m = a*x + b*v and noise n.

Every kind's mean is linear in (x, v) with per-sample coefficients; the log-prob is then an
affine function of S = sum((x' - a*x - b*v)^2): logp = alpha * S + beta. Kernels reduce S and
never form m. The algebra below is DESIGN.md's formulas expanded (the reference keeps them as
written; the tests check the two agree). Arguments are float64 numpy arrays [B]: a few dozen
scalar ops cost microseconds in numpy, against ~10 us per op for tiny torch tensors.
"""

from __future__ import annotations

import math

import numpy as np


def sde_coefficients(
    sigma: np.ndarray,
    sigma_next: np.ndarray,
    eta: np.ndarray,
    kind: str,
    sigma_max: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(a, b, n), each [B]: mean m = a*x + b*v, sample x' = m + n*eps."""
    s, dt = sigma, sigma_next - sigma
    if kind == "flow":
        # At s == 1 the schedule's s_1 (sigma_max) replaces s in the denominator.
        std = eta * np.sqrt(s / (1 - np.where(s == 1, sigma_max, s)))
        a = 1 + std**2 / (2 * s) * dt
        b = (1 + std**2 * (1 - s) / (2 * s)) * dt
        n = std * np.sqrt(-dt)
    elif kind == "dance":
        # score = -(x + (1-s) v) / s, so the score term adds 0.5 eta^2 dt (x + (1-s) v) / s.
        drift = 0.5 * eta**2 * dt / s
        a = 1 + drift
        b = dt + drift * (1 - s)
        n = eta * np.sqrt(-dt)
    elif kind in ("cps", "cps_mse"):
        # m = (1-s')(x - s v) + c (x + (1-s) v), c = sqrt(s'^2 - n^2).
        n = sigma_next * np.sin(eta * (math.pi / 2))
        c = np.sqrt(sigma_next**2 - n**2)
        a = (1 - sigma_next) + c
        b = -(1 - sigma_next) * s + c * (1 - s)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return a, b, n


def logprob_affine(
    n: np.ndarray, kind: str, reduction: str, numel: int
) -> tuple[np.ndarray, np.ndarray]:
    """(alpha, beta), each [B]: logp = alpha * sum((x' - m)^2) + beta over `numel` elements."""
    if kind == "cps_mse":
        # The public CPS code drops the constants and the 1/(2 n^2) factor.
        alpha = -np.ones_like(n)
        beta = np.zeros_like(n)
    else:
        alpha = -1 / (2 * n**2)
        beta = -np.log(n) - 0.5 * math.log(2 * math.pi)
    if reduction == "mean":
        return alpha / numel, beta
    return alpha, beta * numel
