"""The public functional API: validate, normalise the step parameters, dispatch to a backend.

Backends: "reference" (plain torch, autograd), "cpu_fused" (hand-written C kernels with
analytic backward; the default on the CPU), "triton" (the default on CUDA; on the CPU only under
TRITON_INTERPRET=1). `backend=None` picks by device.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from grpo_kernels import reference
from grpo_kernels.autograd import chunk_grpo_loss_fused, sde_logprob_fused, sde_sample_fused
from grpo_kernels.sde_coefficients import StepCoefficients, step_coefficients
from grpo_kernels.validation import (
    check_backend,
    check_chunk_loss_args,
    check_latents,
    check_sde_kind,
    compute_dtype,
    per_sample,
    step_values,
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


def _step_coefficients(x, sigma, sigma_next, eta, sigma_max, kind, reduction, backend):
    """(backend, checked StepCoefficients), cached per distinct step values. The checks keep
    their order: argument types and shapes, then the backend name, then the values."""
    batch, device = x.shape[0], x.device
    values = [step_values(value, name, batch, device)
              for value, name in ((sigma, "sigma"), (sigma_next, "sigma_next"), (eta, "eta"))]
    values.append(None if sigma_max is None else step_values(sigma_max, "sigma_max", batch, device))
    backend = resolve_backend(backend, device)
    numel = x.numel() // batch
    return backend, step_coefficients(kind, reduction, numel, batch, *values)


def _as_tensors(params, device, dtype):
    # torch.tensor copies: the cached arrays are read-only, which torch.from_numpy warns about.
    return tuple(torch.tensor(p, device=device, dtype=dtype) for p in params)


def _logprob(x, v, x_next, coef: StepCoefficients, kind, reduction, backend):
    if backend == "reference":
        params = _as_tensors(coef.params, x.device, compute_dtype(x, v, x_next))
        return reference.sde_step_logprob_reference(x, v, x_next, *params, kind, reduction)
    return sde_logprob_fused(x, v, x_next, coef, backend)


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
) -> torch.Tensor:
    """Log-prob [B] of the SDE transition x -> x_next under velocity v (docs/math.md, "Step kinds").

    x, v, x_next: [B, ...] of any float dtype. sigma, sigma_next, eta: scalars or [B] tensors
    (treated as constants: no gradient). Output is fp32 (fp64 for fp64 inputs). Backward flows
    to v, and to x / x_next when they require grad. `check=True` also rejects NaN/Inf inputs.
    """
    check_latents(check_nan=check, x=x, v=v, x_next=x_next)
    check_sde_kind(kind, reduction)
    backend, coef = _step_coefficients(x, sigma, sigma_next, eta, sigma_max, kind, reduction,
                                       backend)
    return _logprob(x, v, x_next, coef, kind, reduction, backend)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rollout step: x_next = m + n * noise (in x's dtype, no gradient) and its logp [B].

    logp is exactly what `sde_step_logprob(x, v, x_next, ...)` returns for the stored x_next on
    the same backend (mean reduction), so a policy that has not moved reproduces it bit-for-bit.
    """
    check_latents(x=x, v=v, noise=noise)
    check_sde_kind(kind)
    backend, coef = _step_coefficients(x, sigma, sigma_next, eta, sigma_max, kind, "mean",
                                       backend)
    if backend == "reference":
        with torch.no_grad():
            tensors = _as_tensors(coef.params, x.device, compute_dtype(x, v))
            x_next = reference.sde_step_sample_reference(x, v, noise, *tensors, kind)[0]
    else:
        x_next = sde_sample_fused(x, v, noise, coef, backend)
    # The same coefficients and code path as sde_step_logprob on these inputs: bit-identical.
    return x_next, _logprob(x, v, x_next, coef, kind, "mean", backend)


def ode_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
) -> torch.Tensor:
    """Euler ODE step x' = x + (sigma_next - sigma) * v in x's dtype (differentiable).

    Any sigma_next < sigma in [0, 1] is accepted, including the last step into 0.
    """
    check_latents(x=x, v=v)
    dtype = compute_dtype(x, v)
    sigma = per_sample(sigma, "sigma", x.shape[0], x.device)
    sigma_next = per_sample(sigma_next, "sigma_next", x.shape[0], x.device)
    if not ((sigma > 0) & (sigma <= 1)).all():
        raise ValueError(f"sigma must lie in (0, 1], got {sigma.tolist()}")
    if not ((sigma_next >= 0) & (sigma_next < sigma)).all():
        raise ValueError(
            f"sigma_next must satisfy 0 <= sigma_next < sigma, got {sigma_next.tolist()}"
        )
    sigma, sigma_next = _as_tensors((sigma, sigma_next), x.device, dtype)
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Chunk-level PPO-clip GRPO loss (docs/math.md) and detached stats.

    Loss = mean over trained (sample, chunk) pairs of max(-A r, -A clamp(r, 1-clip_low,
    1+clip_high)), r = exp(mean over the chunk's steps of (logp_new - logp_old)), plus kl_coef
    times the mean k3 estimate of KL(new || old) (per step, averaged per chunk like the loss).
    Gradient flows to logp_new only. Stats: clip_frac, ratio_mean/min/max, approx_kl,
    policy_loss, clip_frac_per_chunk / ratio_mean_per_chunk [K] (NaN where no sample trains
    the chunk), trained_per_chunk [K].
    """
    check_chunk_loss_args(
        logp_new, logp_old, advantages, chunk_sizes, chunk_mask, clip_low, clip_high, adv_clip_max
    )
    if check:
        for name, t in (("logp_new", logp_new), ("logp_old", logp_old), ("advantages", advantages)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} contains NaN or Inf")
    chunk_sizes = [int(c) for c in chunk_sizes]
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
