"""Autograd Functions with analytic backward, shared by the "cpu_fused" and "triton" backends.

The SDE log-prob saves only its inputs (no [B, N] temporary): the backward recomputes the
residual x' - a x - b v in the same fused pass that writes the gradient.
"""

from __future__ import annotations

import torch

from grpo_kernels import cpu_fused
from grpo_kernels.sde_coefficients import logprob_affine, sde_coefficients
from grpo_kernels.validation import compute_dtype


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> contiguous [B, N]: a view of contiguous input, else one copy."""
    return t.reshape(t.shape[0], -1).contiguous()


def _kernels(backend: str):
    """The module implementing the fused passes: cpu_fused (C) or triton_kernels."""
    if backend == "triton":
        from grpo_kernels import triton_kernels  # lazy: importing grpo_kernels never needs triton

        return triton_kernels
    return cpu_fused


def _coefficients(params, kind, reduction, numel, backend, device):
    """(a, b, n, alpha, beta) as float64 numpy [B] (cpu_fused) or fp32 tensors (triton)."""
    a, b, n = sde_coefficients(*params[:3], kind, params[3])
    coef = (a, b, n, *logprob_affine(n, kind, reduction, numel))
    if backend == "triton":
        coef = tuple(torch.from_numpy(c).to(device=device, dtype=torch.float32) for c in coef)
    return coef


class SdeStepLogprobFunction(torch.autograd.Function):
    """logp[i] = alpha[i] * sum_k (x'[i,k] - a[i] x[i,k] - b[i] v[i,k])^2 + beta[i].

    params: checked (sigma, sigma_next, eta, sigma_max) float64 numpy arrays [B] (constants).
    """

    @staticmethod
    def forward(ctx, x, v, x_next, params, kind, reduction, backend):
        a, b, _, alpha, beta = _coefficients(params, kind, reduction, x[0].numel(), backend,
                                             x.device)
        x2, v2, xn2 = _flat(x), _flat(v), _flat(x_next)
        logp = _kernels(backend).sde_logprob_fwd(x2, v2, xn2, a, b, alpha, beta)
        if logp.dtype != compute_dtype(x, v, x_next):
            logp = logp.to(compute_dtype(x, v, x_next))
        ctx.save_for_backward(x, v, x_next)
        ctx.coef, ctx.backend = (a, b, alpha), backend
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        x, v, x_next = ctx.saved_tensors
        a, b, alpha = ctx.coef
        want = tuple(ctx.needs_input_grad[:3])
        x2, v2, xn2 = _flat(x), _flat(v), _flat(x_next)
        if ctx.backend == "triton":
            grad = grad_logp.to(torch.float32)
        else:
            grad = grad_logp.detach().to("cpu", torch.float64).numpy()
        scale = 2 * alpha * grad  # d logp / d x' = 2 alpha (x' - m)
        grads = _kernels(ctx.backend).sde_logprob_bwd(x2, v2, xn2, a, b, scale, *want)
        grads = [None if g is None else g.reshape(like.shape)
                 for g, like in zip(grads, (x, v, x_next), strict=True)]
        return (*grads, None, None, None, None)


def sde_sample_fused(x, v, noise, params, kind, backend):
    """x' = m + n * eps in x's dtype, without autograd (a rollout step)."""
    a, b, n, _, _ = _coefficients(params, kind, "mean", x[0].numel(), backend, x.device)
    x2, v2, e2 = _flat(x.detach()), _flat(v.detach()), _flat(noise)
    with torch.no_grad():
        out = _kernels(backend).sde_sample(x2, v2, e2, a, b, n)
    return out.reshape(x.shape)


def _chunk_index(chunk_sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[S] chunk id of every step."""
    sizes = torch.tensor(chunk_sizes, device=device)
    return torch.repeat_interleave(torch.arange(len(chunk_sizes), device=device), sizes)


def chunk_terms_torch(delta, advantages, chunk_id, sizes, clip_low, clip_high):
    """Per (sample, chunk): ratio, loss, d loss / d log-ratio, and mean k3, in one pass."""
    batch, num_chunks = delta.shape[0], sizes.shape[0]
    log_ratio = delta.new_zeros(batch, num_chunks).index_add_(1, chunk_id, delta) / sizes
    ratio = torch.exp(log_ratio)  # exactly 1.0 when logp_new == logp_old bit-for-bit
    unclipped = -advantages[:, None] * ratio
    clipped = -advantages[:, None] * ratio.clamp(1 - clip_low, 1 + clip_high)
    take_unclipped = unclipped >= clipped
    loss = torch.where(take_unclipped, unclipped, clipped)
    # d max(...) / d log r: the clipped branch is flat wherever it wins.
    grad_log_ratio = torch.where(take_unclipped, unclipped, torch.zeros_like(unclipped))
    k3 = torch.exp(-delta) + delta - 1
    kl = delta.new_zeros(batch, num_chunks).index_add_(1, chunk_id, k3) / sizes
    return ratio, loss, grad_log_ratio, kl


class ChunkGrpoLossFunction(torch.autograd.Function):
    """Loss = sum_ij w_ij (L_ij + kl_coef * KL_ij), w = chunk_mask / number trained."""

    @staticmethod
    def forward(ctx, logp_new, logp_old, advantages, weight, chunk_sizes, clip_low, clip_high,
                kl_coef, backend):
        dtype = weight.dtype
        delta = logp_new.to(dtype) - logp_old.to(dtype)
        chunk_id = _chunk_index(chunk_sizes, delta.device)
        sizes = torch.tensor(chunk_sizes, dtype=dtype, device=delta.device)
        if backend == "triton":
            ratio, loss, grad_log_ratio, kl = _kernels("triton").chunk_terms(
                delta, advantages.to(dtype), chunk_sizes, clip_low, clip_high
            )
        else:
            ratio, loss, grad_log_ratio, kl = chunk_terms_torch(
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
    from grpo_kernels.reference import chunk_stats

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
