"""Per-sample scalars of one SDE step, so fused kernels only see m = a*x + b*v and noise n.

Every kind's mean is linear in (x, v) with per-sample coefficients; the log-prob is then an
affine function of S = sum((x' - a*x - b*v)^2): logp = alpha * S + beta. Kernels reduce S and
never form m. The algebra below is docs/math.md's formulas expanded (the reference keeps them as
written; the tests check the two agree).

The C kernels (csrc/sde_step.c, `step_coefficients`) and the Triton kernels
(triton_kernels._coefficients) compute the same expressions per row, inside the kernel, from
the step's parameters on the latents' device; this torch version serves the eager paths (float64
inputs, no C compiler, other devices). All are tensor ops: nothing is read back to the host.
"""

from __future__ import annotations

import math

import torch

from grpo_kernels.step_params import StepParams, all_rows


def sde_coefficients(
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    eta: torch.Tensor,
    kind: str,
    sigma_max: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, b, n), each [B]: mean m = a*x + b*v, sample x' = m + n*eps."""
    s, dt = sigma, sigma_next - sigma
    if kind == "flow":
        # At s == 1 the schedule's s_1 (sigma_max) replaces s in the denominator.
        std = eta * torch.sqrt(s / (1 - torch.where(s == 1, sigma_max, s)))
        a = 1 + std**2 / (2 * s) * dt
        b = (1 + std**2 * (1 - s) / (2 * s)) * dt
        n = std * torch.sqrt(-dt)
    elif kind == "dance":
        # score = -(x + (1-s) v) / s, so the score term adds 0.5 eta^2 dt (x + (1-s) v) / s.
        drift = 0.5 * eta**2 * dt / s
        a = 1 + drift
        b = dt + drift * (1 - s)
        n = eta * torch.sqrt(-dt)
    elif kind in ("cps", "cps_mse"):
        # m = (1-s')(x - s v) + c (x + (1-s) v), c = sqrt(s'^2 - n^2).
        n = sigma_next * torch.sin(eta * (math.pi / 2))
        c = torch.sqrt(sigma_next**2 - n**2)
        a = (1 - sigma_next) + c
        b = -(1 - sigma_next) * s + c * (1 - s)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return a, b, n


def logprob_affine(
    n: torch.Tensor, kind: str, reduction: str, numel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha, beta), each [B]: logp = alpha * sum((x' - m)^2) + beta over `numel` elements."""
    if kind == "cps_mse":
        # The public CPS code drops the constants and the 1/(2 n^2) factor.
        alpha = -torch.ones_like(n)
        beta = torch.zeros_like(n)
    else:
        alpha = -1 / (2 * n**2)
        beta = -torch.log(n) - 0.5 * math.log(2 * math.pi)
    if reduction == "mean":
        return alpha / numel, beta
    return alpha, beta * numel


def step_coefficients(
    step: StepParams, kind: str, reduction: str, numel: int, batch: int, device: torch.device,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, ...]:
    """(a, b, n, alpha, beta), each [B] of `dtype` on `device` (float64 by default, like the C
    kernels' own arithmetic)."""
    sigma, sigma_next, eta, sigma_max = all_rows(step, batch, dtype, device)
    # + 0.0: a -0.0 parameter computes as 0.0, as in the C kernels.
    a, b, n = sde_coefficients(sigma + 0.0, sigma_next + 0.0, eta + 0.0, kind, sigma_max + 0.0)
    return (a, b, n, *logprob_affine(n, kind, reduction, numel))
