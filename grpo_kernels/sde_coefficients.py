"""Per-sample scalars of one SDE step, so fused kernels only see m = a*x + b*v and noise n.

Every kind's mean is linear in (x, v) with per-sample coefficients; the log-prob is then an
affine function of S = sum((x' - a*x - b*v)^2): logp = alpha * S + beta. Kernels reduce S and
never form m. The algebra below is docs/math.md's formulas expanded (the reference keeps them as
written; the tests check the two agree). Arguments are float64 numpy arrays [B]: a few dozen
scalar ops cost microseconds in numpy, against ~10 us per op for tiny torch tensors.
`step_coefficients` checks and computes them once per distinct set of step values (cached).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from grpo_kernels.validation import broadcast, check_sde_args


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


# Rows of StepCoefficients.table64 / table32.
A, B, N, ALPHA, BETA = range(5)


class StepCoefficients(NamedTuple):
    """One step's checked parameters and coefficients, shared by every call with the same
    values (see step_coefficients): all arrays are read-only."""

    params: tuple[np.ndarray, ...]  # sigma, sigma_next, eta, sigma_max: float64 [B]
    table64: np.ndarray  # float64 [5, B]: rows a, b, n, alpha, beta
    table32: np.ndarray  # the same rounded to fp32: what the C kernels read
    base64: int  # addresses of the tables, read once (numpy's .ctypes costs ~1 us a call)
    base32: int

    def row(self, index: int) -> np.ndarray:
        return self.table64[index]

    def address64(self, index: int) -> int:
        """Address of a float64 row, for ctypes (valid while this object lives)."""
        return self.base64 + index * self.table64.strides[0]

    def address32(self, index: int) -> int:
        return self.base32 + index * self.table32.strides[0]


@functools.lru_cache(maxsize=256)
def step_coefficients(
    kind: str,
    reduction: str,
    numel: int,
    batch: int,
    sigma: tuple[float, ...],
    sigma_next: tuple[float, ...],
    eta: tuple[float, ...],
    sigma_max: tuple[float, ...] | None,
) -> StepCoefficients:
    """Check the step parameters (validation.step_values tuples) and compute every
    coefficient, once per distinct set of values.

    The key is the values themselves, never a tensor's identity, so a tensor changed in place
    gets fresh coefficients. A rollout or training step repeats a handful of (sigma,
    sigma_next) pairs, so hits skip the checks and the numpy algebra (~25 us a call). Invalid
    values raise each time: lru_cache does not store exceptions.
    """
    # + 0.0: -0.0 and 0.0 share a key, so compute with 0.0 whichever came first.
    params = tuple(broadcast(values, batch) + 0.0
                   for values in (sigma, sigma_next, eta, sigma_max))
    check_sde_args(kind, *params)
    a, b, n = sde_coefficients(*params[:3], kind, params[3])
    table64 = np.stack((a, b, n, *logprob_affine(n, kind, reduction, numel)))
    table32 = table64.astype(np.float32)
    for array in (*params, table64, table32):
        array.setflags(write=False)
    return StepCoefficients(params, table64, table32, table64.ctypes.data, table32.ctypes.data)
