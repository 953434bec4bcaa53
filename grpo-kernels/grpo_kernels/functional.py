"""The public functional API: check the arguments, normalise the step, dispatch to a backend.

Backends: "reference" (plain torch, autograd), "cpu_fused" (hand-written C kernels with
analytic backward; the default on the CPU), "triton" (the default on CUDA; on the CPU only under
TRITON_INTERPRET=1). `backend=None` picks by device. Every backend takes the step's parameters
as given (floats or tensors on the latents' device) and computes its coefficients there.

`validate=True` (the default) also checks the VALUES of the step parameters, the noise and the
chunk mask, which reads them on the host: on CUDA one sync per call. `validate=False` skips
those value checks (argument types, shapes and devices are still checked): the fast path for
a caller whose values are known good, and the way to call these functions under
torch.compile(fullgraph=True) without a graph break.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from grpo_kernels import reference
from grpo_kernels.autograd import chunk_grpo_loss_fused, sde_logprob_fused, sde_sample_fused
from grpo_kernels.step_params import StepParams, step_params, step_rows, step_value
from grpo_kernels.validation import (
    check_backend,
    check_chunk_loss_args,
    check_chunk_mask_values,
    check_latents,
    check_noise_finite,
    check_sde_kind,
    check_step_values,
    compute_dtype,
)


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """None -> "triton" on CUDA, "cpu_fused" elsewhere; an explicit name is checked."""
    check_backend(backend)
    if backend is None:
        return "triton" if device.type == "cuda" else "cpu_fused"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
            "imported, for tests on the CPU); use backend='cpu_fused' on the CPU"
        )
    return backend


def _checked_step(x, sigma, sigma_next, eta, sigma_max, kind, backend, validate):
    """(backend, StepParams). The checks keep their order: argument types and shapes, then
    the backend name, then (validate=True) the values."""
    step = step_params(x, sigma, sigma_next, eta, sigma_max)
    backend = resolve_backend(backend, x.device)
    if validate:
        check_step_values(step, kind, x.shape[0])
    return backend, step


def _logprob(x, v, x_next, step: StepParams, kind, reduction, backend):
    if backend == "reference":
        return reference.sde_step_logprob(x, v, x_next, step, kind, reduction)
    return sde_logprob_fused(x, v, x_next, step, kind, reduction, backend)


def sde_step_logprob(
    x: torch.Tensor,
    v: torch.Tensor,
    x_next: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    eta: float | torch.Tensor,
    kind: str = "flow",
    sigma_max: float | torch.Tensor | None = None,
    reduction: str = "mean",
    backend: str | None = None,
    check: bool = False,
    validate: bool = True,
) -> torch.Tensor:
    """Log-prob [B] of the SDE transition x -> x_next under velocity v (docs/math.md, "Step kinds").

    x, v, x_next: [B, ...] of any float dtype. sigma, sigma_next, eta, sigma_max: real numbers
    or [B] / 0-d tensors on the latents' device (treated as constants: no gradient). Output is
    fp32 (fp64 for fp64 inputs). Backward flows to v, and to x / x_next when they require grad.
    `check=True` also rejects NaN/Inf latents; `validate=False` skips the value checks (see the
    module docstring).
    """
    check_latents(check_nan=check, x=x, v=v, x_next=x_next)
    check_sde_kind(kind, reduction)
    backend, step = _checked_step(x, sigma, sigma_next, eta, sigma_max, kind, backend, validate)
    return _logprob(x, v, x_next, step, kind, reduction, backend)


def sde_step_sample(
    x: torch.Tensor,
    v: torch.Tensor,
    noise: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    eta: float | torch.Tensor,
    kind: str = "flow",
    sigma_max: float | torch.Tensor | None = None,
    backend: str | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rollout step: x_next = m + n * noise (in x's dtype, no gradient) and its logp [B].

    logp is exactly what `sde_step_logprob(x, v, x_next, ...)` returns for the stored x_next on
    the same backend (mean reduction), so a policy that has not moved reproduces it bit-for-bit.
    With validate=True a NaN or Inf in the noise raises (checked through the [B] log-prob).
    """
    check_latents(x=x, v=v, noise=noise)
    check_sde_kind(kind)
    backend, step = _checked_step(x, sigma, sigma_next, eta, sigma_max, kind, backend, validate)
    if backend == "reference":
        x_next = reference.sde_step_sample(x, v, noise, step, kind)
    else:
        x_next = sde_sample_fused(x, v, noise, step, kind, backend)
    # The same parameters and code path as sde_step_logprob on these inputs: bit-identical.
    logp = _logprob(x, v, x_next, step, kind, "mean", backend)
    if validate:
        check_noise_finite(noise, logp)
    return x_next, logp


def ode_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Euler ODE step x' = x + (sigma_next - sigma) * v in x's dtype (differentiable).

    Any sigma_next < sigma in [0, 1] is accepted, including the last step into 0.
    """
    check_latents(x=x, v=v)
    batch, device = x.shape[0], x.device
    sigma = step_value(sigma, "sigma", batch, device)
    sigma_next = step_value(sigma_next, "sigma_next", batch, device)
    if validate:
        # eta = 1 and kind "dance" ask for exactly sigma in (0, 1], 0 <= sigma_next < sigma.
        check_step_values(StepParams(sigma, sigma_next, 1.0, 0.5), "dance", batch)
    dtype = compute_dtype(x, v)
    sigma, sigma_next = (step_rows(s, batch, dtype, device) for s in (sigma, sigma_next))
    if x.dtype == v.dtype == dtype:
        # One fused op (addcmul) in the input dtype: nothing to upcast.
        dt = (sigma_next - sigma).reshape(-1, *([1] * (x.dim() - 1)))
        return torch.addcmul(x, dt, v)
    return reference.ode_step_reference(x, v, sigma, sigma_next)


def chunk_grpo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    chunk_sizes: Sequence[int],
    *,
    chunk_mask: torch.Tensor | None = None,
    clip_low: float,
    clip_high: float,
    adv_clip_max: float | None = None,
    kl_coef: float = 0.0,
    backend: str | None = None,
    check: bool = False,
    validate: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Chunk-level PPO-clip GRPO loss (docs/math.md) and detached stats.

    Loss = mean over trained (sample, chunk) pairs of max(-A r, -A clamp(r, 1-clip_low,
    1+clip_high)), r = exp(mean over the chunk's steps of (logp_new - logp_old)), plus kl_coef
    times the mean k3 estimate of KL(new || old) (per step, averaged per chunk like the loss).
    Gradient flows to logp_new only. Stats: clip_frac, ratio_mean/min/max, approx_kl,
    policy_loss, clip_frac_per_chunk / ratio_mean_per_chunk [K] (NaN where no sample trains
    the chunk), trained_per_chunk [K]. The numbers (clip_low, clip_high, adv_clip_max >0 or
    None, kl_coef >= 0) must be finite; `validate=False` skips only the chunk_mask value check.
    """
    check_chunk_loss_args(
        logp_new, logp_old, advantages, chunk_sizes, chunk_mask, clip_low, clip_high,
        adv_clip_max, kl_coef,
    )
    if validate:
        check_chunk_mask_values(chunk_mask)
    if check:
        for name, t in (("logp_new", logp_new), ("logp_old", logp_old), ("advantages", advantages)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} contains NaN or Inf")
    chunk_sizes = [int(c) for c in chunk_sizes]
    clip_low, clip_high, kl_coef = float(clip_low), float(clip_high), float(kl_coef)
    adv_clip_max = None if adv_clip_max is None else float(adv_clip_max)
    backend = resolve_backend(backend, logp_new.device)
    logp_old, advantages = logp_old.detach(), advantages.detach()
    if backend == "reference":
        return reference.chunk_grpo_loss_reference(
            logp_new, logp_old, advantages, chunk_sizes, chunk_mask,
            clip_low, clip_high, adv_clip_max, kl_coef,
        )
    return chunk_grpo_loss_fused(
        logp_new, logp_old, advantages, chunk_sizes, chunk_mask,
        clip_low, clip_high, adv_clip_max, kl_coef, backend,
    )
