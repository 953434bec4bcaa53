"""Autograd Functions with analytic backward, shared by the "cpu_fused" and "triton" backends.

Both backend modules take the same arguments (one calling convention):
  sde_logprob_fwd(x, v, x_next, step, kind, reduction) -> logp [B]
  sde_logprob_bwd(x, v, x_next, step, kind, reduction, grad_logp, want_x, want_v, want_next)
  sde_sample(x, v, noise, step, kind) -> x_next
  chunk_terms(delta, advantages, chunk_id, sizes, clip_low, clip_high) -> ratio, loss, dL, kl
with x, v, x_next, noise [B, ...] and `step` a StepParams on the latents' device; each computes
the step's coefficients on that device (inside its kernels), so no call reads back to the host.

The SDE log-prob saves only its inputs (no [B, N] temporary): the backward recomputes the
residual x' - a x - b v in the same fused pass that writes the gradient.
"""

from __future__ import annotations

import functools

import torch

from grpo_kernels import cpu_fused
from grpo_kernels.reference import chunk_stats
from grpo_kernels.step_params import StepParams
from grpo_kernels.validation import compute_dtype


def kernels(backend: str):
    """The backend module implementing the fused passes: cpu_fused (C) or triton_kernels."""
    if backend == "triton":
        try:  # lazy: importing grpo_kernels never needs triton
            from grpo_kernels import triton_kernels
        except ModuleNotFoundError as err:
            if err.name != "triton":
                raise
            raise ModuleNotFoundError(
                "backend='triton' needs the triton package: pip install 'grpo-kernels[triton]' "
                "(torch's CUDA builds bring it), or use backend='cpu_fused' / 'reference'",
                name="triton") from err
        return triton_kernels
    return cpu_fused


def _logprob_forward(x, v, x_next, step, kind, reduction, backend):
    """logp [B] in the compute dtype, without autograd."""
    logp = kernels(backend).sde_logprob_fwd(x, v, x_next, step, kind, reduction)
    dtype = compute_dtype(x, v, x_next)
    return logp if logp.dtype == dtype else logp.to(dtype)


class SdeStepLogprobFunction(torch.autograd.Function):
    """logp[i] = alpha[i] * sum_k (x'[i,k] - a[i] x[i,k] - b[i] v[i,k])^2 + beta[i].

    step: the step's StepParams (constants, no gradient).
    """

    @staticmethod
    def forward(ctx, x, v, x_next, step: StepParams, kind, reduction, backend):
        ctx.save_for_backward(x, v, x_next)
        ctx.step, ctx.kind, ctx.reduction, ctx.backend = step, kind, reduction, backend
        return _logprob_forward(x, v, x_next, step, kind, reduction, backend)

    @staticmethod
    def backward(ctx, grad_logp):
        x, v, x_next = ctx.saved_tensors
        want = tuple(ctx.needs_input_grad[:3])
        grads = kernels(ctx.backend).sde_logprob_bwd(x, v, x_next, ctx.step, ctx.kind,
                                                     ctx.reduction, grad_logp, *want)
        return (*grads, None, None, None, None)


def sde_logprob_fused(x, v, x_next, step, kind, reduction, backend):
    """The fused log-prob; autograd's Function only when a gradient can flow (rollouts and
    no_grad evaluation skip its per-call cost)."""
    if torch.is_grad_enabled() and (x.requires_grad or v.requires_grad or x_next.requires_grad):
        return SdeStepLogprobFunction.apply(x, v, x_next, step, kind, reduction, backend)
    return _logprob_forward(x, v, x_next, step, kind, reduction, backend)


def sde_sample_fused(x, v, noise, step, kind, backend):
    """x' = m + n * eps in x's dtype, without autograd (a rollout step)."""
    with torch.no_grad():
        return kernels(backend).sde_sample(x.detach(), v.detach(), noise, step, kind)


@functools.lru_cache(maxsize=64)
def chunk_index(chunk_sizes: tuple[int, ...], device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """([S] chunk id of every step, [K] sizes in `dtype`) on `device`, built once per layout:
    a host-to-device copy waits for the device on CUDA, so it must not run every call.
    Built outside inference mode, so a first call under it cannot poison later training."""
    with torch.inference_mode(False):
        return _chunk_index(chunk_sizes, device, dtype)


def _chunk_index(chunk_sizes, device, dtype):
    sizes = torch.tensor(chunk_sizes, dtype=dtype, device=device)
    steps = torch.tensor([k for k, size in enumerate(chunk_sizes) for _ in range(size)],
                         device=device)
    return steps, sizes


class ChunkGrpoLossFunction(torch.autograd.Function):
    """Loss = sum_ij w_ij (L_ij + kl_coef * KL_ij), w = chunk_mask / number trained."""

    @staticmethod
    def forward(ctx, logp_new, logp_old, advantages, weight, chunk_sizes, clip_low, clip_high,
                kl_coef, backend):
        dtype = weight.dtype
        delta = logp_new.to(dtype) - logp_old.to(dtype)
        chunk_id, sizes = chunk_index(chunk_sizes, delta.device, dtype)
        ratio, loss, grad_log_ratio, kl = kernels(backend).chunk_terms(
            delta, advantages.to(dtype), chunk_id, sizes, clip_low, clip_high
        )
        ctx.save_for_backward(delta, grad_log_ratio, weight, chunk_id, sizes)
        ctx.kl_coef = kl_coef
        ctx.new_dtype = logp_new.dtype
        policy_loss = (loss * weight).sum()
        kl_mean = (kl * weight).sum()
        ctx.mark_non_differentiable(ratio, policy_loss, kl_mean)
        return policy_loss + kl_coef * kl_mean, ratio, policy_loss, kl_mean

    @staticmethod
    def backward(ctx, grad_loss, _grad_ratio, _grad_policy, _grad_kl):
        delta, grad_log_ratio, weight, chunk_id, sizes = ctx.saved_tensors
        per_chunk = grad_log_ratio * weight / sizes  # d log r_ij / d logp_t = 1 / size_j
        grad = per_chunk[:, chunk_id]
        if ctx.kl_coef != 0.0:
            # d k3 / d delta = 1 - exp(-delta), averaged over the chunk's steps.
            grad = grad + ctx.kl_coef * (weight / sizes)[:, chunk_id] * (1 - torch.exp(-delta))
        grad = (grad * grad_loss.to(grad.dtype)).to(ctx.new_dtype)
        return grad, None, None, None, None, None, None, None, None


def chunk_grpo_loss_fused(logp_new, logp_old, advantages, chunk_sizes, chunk_mask, clip_low,
                          clip_high, adv_clip_max, kl_coef, backend):
    dtype = torch.float64 if logp_new.dtype == torch.float64 else torch.float32
    if adv_clip_max is not None:
        advantages = advantages.clamp(-adv_clip_max, adv_clip_max)
    if chunk_mask is None:
        chunk_mask = torch.ones(
            logp_new.shape[0], len(chunk_sizes), dtype=torch.bool, device=logp_new.device
        )
    weight = chunk_mask.to(dtype)
    weight = weight / weight.sum()
    loss, ratio, policy_loss, kl = ChunkGrpoLossFunction.apply(
        logp_new, logp_old, advantages, weight, tuple(chunk_sizes), clip_low, clip_high,
        kl_coef, backend,
    )
    stats = chunk_stats(ratio, chunk_mask, clip_low, clip_high)
    stats["policy_loss"] = policy_loss.detach()
    stats["approx_kl"] = kl.detach()
    return loss, stats
