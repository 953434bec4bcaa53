"""Autograd Functions with analytic backward, shared by the "cpu_fused" and "triton" backends.

The SDE log-prob saves only its inputs (no [B, N] temporary): the backward recomputes the
residual x' - a x - b v in the same fused pass that writes the gradient. Its per-sample
coefficients come precomputed and cached (sde_coefficients.step_coefficients).
"""

from __future__ import annotations

import torch

from grpo_kernels import cpu_fused
from grpo_kernels.sde_coefficients import StepCoefficients
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


def _device_rows(coef: StepCoefficients, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Triton reads the coefficients as fp32 tensors [B] on the latents' device."""
    # torch.tensor copies: the cached table is read-only, which torch.from_numpy warns about.
    return torch.tensor(coef.table32, device=device).unbind(0)


def _logprob_forward(x, v, x_next, coef, backend):
    """logp [B] in the compute dtype, without autograd."""
    if backend == "triton":
        a, b, _, alpha, beta = _device_rows(coef, x.device)
        logp = _kernels(backend).sde_logprob_fwd(_flat(x), _flat(v), _flat(x_next), a, b,
                                                 alpha, beta)
    else:
        logp = cpu_fused.sde_logprob_fwd(x, v, x_next, coef)
    dtype = compute_dtype(x, v, x_next)
    return logp if logp.dtype == dtype else logp.to(dtype)


def _triton_backward(x, v, x_next, coef, grad_logp, want):
    a, b, _, alpha, _ = _device_rows(coef, x.device)
    scale = 2 * alpha * grad_logp.to(torch.float32)  # d logp / d x' = 2 alpha (x' - m)
    grads = _kernels("triton").sde_logprob_bwd(_flat(x), _flat(v), _flat(x_next), a, b, scale,
                                               *want)
    return tuple(None if g is None else g.reshape(like.shape)
                 for g, like in zip(grads, (x, v, x_next), strict=True))


class SdeStepLogprobFunction(torch.autograd.Function):
    """logp[i] = alpha[i] * sum_k (x'[i,k] - a[i] x[i,k] - b[i] v[i,k])^2 + beta[i].

    coef: the step's StepCoefficients (constants, no gradient).
    """

    @staticmethod
    def forward(ctx, x, v, x_next, coef, backend):
        ctx.save_for_backward(x, v, x_next)
        ctx.coef, ctx.backend = coef, backend
        return _logprob_forward(x, v, x_next, coef, backend)

    @staticmethod
    def backward(ctx, grad_logp):
        x, v, x_next = ctx.saved_tensors
        want = tuple(ctx.needs_input_grad[:3])
        if ctx.backend == "triton":
            grads = _triton_backward(x, v, x_next, ctx.coef, grad_logp, want)
        else:
            grads = cpu_fused.sde_logprob_bwd(x, v, x_next, ctx.coef, grad_logp, *want)
        return (*grads, None, None)


def sde_logprob_fused(x, v, x_next, coef, backend):
    """The fused log-prob; autograd's Function only when a gradient can flow (rollouts and
    no_grad evaluation skip its per-call cost)."""
    if torch.is_grad_enabled() and (x.requires_grad or v.requires_grad or x_next.requires_grad):
        return SdeStepLogprobFunction.apply(x, v, x_next, coef, backend)
    return _logprob_forward(x, v, x_next, coef, backend)


def sde_sample_fused(x, v, noise, coef, backend):
    """x' = m + n * eps in x's dtype, without autograd (a rollout step)."""
    x, v = x.detach(), v.detach()
    with torch.no_grad():
        if backend == "triton":
            a, b, n, _, _ = _device_rows(coef, x.device)
            out = _kernels(backend).sde_sample(_flat(x), _flat(v), _flat(noise), a, b, n)
            return out.reshape(x.shape)
        return cpu_fused.sde_sample(x, v, noise, coef)


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
