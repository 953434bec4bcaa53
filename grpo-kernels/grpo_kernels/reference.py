"""Plain torch reference of every op: the ground truth in tests, written as docs/math.md states it.

Inputs are already validated; sigma, sigma_next and eta are [B] tensors of the compute dtype.
Everything is computed in that dtype (fp32, or fp64 for fp64 inputs); autograd gives backward.
As a backend, `sde_step_logprob` / `sde_step_sample` take the same arguments as the fused ones
(x, v, x_next or noise, StepParams, kind[, reduction]). Only tensor ops, no host reads: the
reference traces under torch.compile(fullgraph=True).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from grpo_kernels.step_params import StepParams, all_rows


def _per_sample_view(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, ..., 1] so it broadcasts against a [B, ...] latent."""
    return t.reshape(-1, *([1] * (like.dim() - 1)))


def sde_mean_and_noise_reference(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    eta: torch.Tensor,
    sigma_max: torch.Tensor,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SDE step's mean m [B, ...] and noise scale n [B, 1, ...] (x' = m + n * eps)."""
    s = _per_sample_view(sigma, x)
    s_next = _per_sample_view(sigma_next, x)
    eta = _per_sample_view(eta, x)
    dt = s_next - s
    if kind == "flow":
        s_max = _per_sample_view(sigma_max, x)
        s_denominator = torch.where(s == 1, s_max, s)
        std = eta * torch.sqrt(s / (1 - s_denominator))
        mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
        noise = std * torch.sqrt(-dt)
    elif kind == "dance":
        x0 = x - s * v
        score = -(x - (1 - s) * x0) / s**2
        mean = x + dt * v + (-0.5 * eta**2 * score) * dt
        noise = eta * torch.sqrt(-dt)
    elif kind in ("cps", "cps_mse"):
        noise = s_next * torch.sin(eta * math.pi / 2)
        x0 = x - s * v
        x1 = x + (1 - s) * v
        mean = (1 - s_next) * x0 + torch.sqrt(s_next**2 - noise**2) * x1
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return mean, noise


def sde_step_logprob_reference(
    x: torch.Tensor,
    v: torch.Tensor,
    x_next: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    eta: torch.Tensor,
    sigma_max: torch.Tensor,
    kind: str,
    reduction: str,
) -> torch.Tensor:
    """Per-sample log-prob of the transition x -> x_next: mean (or sum) over latent elements."""
    dtype = sigma.dtype
    x, v, x_next = x.to(dtype), v.to(dtype), x_next.to(dtype)
    mean, noise = sde_mean_and_noise_reference(x, v, sigma, sigma_next, eta, sigma_max, kind)
    if kind == "cps_mse":
        # The public CPS code drops the constants and the 1/(2 n^2) factor.
        logp = -((x_next - mean) ** 2)
    else:
        logp = (
            -((x_next - mean) ** 2) / (2 * noise**2)
            - torch.log(noise)
            - 0.5 * math.log(2 * math.pi)
        )
    dims = tuple(range(1, x.dim()))
    return logp.mean(dim=dims) if reduction == "mean" else logp.sum(dim=dims)


def sde_step_sample_reference(
    x: torch.Tensor,
    v: torch.Tensor,
    noise_sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    eta: torch.Tensor,
    sigma_max: torch.Tensor,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x' = m + n * eps stored in x's dtype, and the log-prob of that stored x' (mean reduction)."""
    dtype = sigma.dtype
    mean, noise = sde_mean_and_noise_reference(
        x.to(dtype), v.to(dtype), sigma, sigma_next, eta, sigma_max, kind
    )
    x_next = (mean + noise * noise_sample.to(dtype)).to(x.dtype)
    logp = sde_step_logprob_reference(
        x, v, x_next, sigma, sigma_next, eta, sigma_max, kind, "mean"
    )
    return x_next, logp


def _compute_rows(step: StepParams, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    like = tensors[0]
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    return all_rows(step, like.shape[0], dtype, like.device)


def sde_step_logprob(x, v, x_next, step: StepParams, kind: str, reduction: str) -> torch.Tensor:
    """The backend entry: the step as StepParams (see autograd.py's calling convention)."""
    return sde_step_logprob_reference(x, v, x_next, *_compute_rows(step, x, v, x_next), kind,
                                      reduction)


def sde_step_sample(x, v, noise, step: StepParams, kind: str) -> torch.Tensor:
    """The backend entry: x' in x's dtype, without autograd."""
    with torch.no_grad():
        return sde_step_sample_reference(x, v, noise, *_compute_rows(step, x, v), kind)[0]


def ode_step_reference(
    x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
) -> torch.Tensor:
    """Euler step of the flow ODE: x' = x + (sigma' - sigma) * v, in x's dtype."""
    dtype = sigma.dtype
    dt = _per_sample_view(sigma_next - sigma, x)
    return (x.to(dtype) + dt * v.to(dtype)).to(x.dtype)


def chunk_grpo_loss_reference(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    chunk_sizes: Sequence[int],
    chunk_mask: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    adv_clip_max: float | None,
    kl_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Chunk-level PPO-clip loss, one chunk at a time, as docs/math.md writes it."""
    dtype = torch.float64 if logp_new.dtype == torch.float64 else torch.float32
    logp_new, logp_old, advantages = logp_new.to(dtype), logp_old.to(dtype), advantages.to(dtype)
    if adv_clip_max is not None:
        advantages = advantages.clamp(-adv_clip_max, adv_clip_max)
    batch = logp_new.shape[0]
    if chunk_mask is None:
        chunk_mask = torch.ones(batch, len(chunk_sizes), dtype=torch.bool, device=logp_new.device)
    ratios, losses, kls = [], [], []
    start = 0
    for size in chunk_sizes:
        log_ratio_steps = logp_new[:, start : start + size] - logp_old[:, start : start + size]
        ratio = torch.exp(log_ratio_steps.mean(dim=1))
        unclipped = -advantages * ratio
        clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
        losses.append(torch.maximum(unclipped, clipped))
        # k3 estimate of KL(new || old) per step, averaged over the chunk's steps.
        k3 = torch.exp(-log_ratio_steps) + log_ratio_steps - 1
        kls.append(k3.mean(dim=1))
        ratios.append(ratio)
        start += size
    ratio = torch.stack(ratios, dim=1)  # [B, K]
    loss_per_chunk = torch.stack(losses, dim=1)
    kl_per_chunk = torch.stack(kls, dim=1)
    weight = chunk_mask.to(dtype)
    count = weight.sum()
    policy_loss = (loss_per_chunk * weight).sum() / count
    kl = (kl_per_chunk * weight).sum() / count
    loss = policy_loss + kl_coef * kl
    stats = chunk_stats(ratio.detach(), chunk_mask, clip_low, clip_high)
    stats["policy_loss"] = policy_loss.detach()
    stats["approx_kl"] = kl.detach()
    return loss, stats


def chunk_stats(
    ratio: torch.Tensor, chunk_mask: torch.Tensor, clip_low: float, clip_high: float
) -> dict[str, torch.Tensor]:
    """Ratio and clip stats over the trained (sample, chunk) pairs; NaN for untrained chunks."""
    clipped = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)) & chunk_mask
    trained_per_chunk = chunk_mask.sum(dim=0)
    trained = chunk_mask.sum()
    # Masked reductions, not ratio[chunk_mask]: no data-dependent shape, so no host sync and
    # no graph break under torch.compile.
    inf = torch.full_like(ratio, math.inf)
    return {
        "clip_frac": clipped.sum() / trained,
        "ratio_mean": torch.where(chunk_mask, ratio, 0.0).sum() / trained,
        "ratio_min": torch.where(chunk_mask, ratio, inf).min(),
        "ratio_max": torch.where(chunk_mask, ratio, -inf).max(),
        "clip_frac_per_chunk": clipped.sum(dim=0) / trained_per_chunk,
        "ratio_mean_per_chunk": (ratio * chunk_mask).sum(dim=0) / trained_per_chunk,
        "trained_per_chunk": trained_per_chunk,
    }
