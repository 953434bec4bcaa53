"""Fused CPU kernels: small torch functions that Inductor compiles into one C++ loop each.

Each reads the [B, N] latents once and never writes the SDE mean (or any other [B, N]
temporary). The per-sample coefficients of every kind and the parameter checks are computed
inside the same compiled graph (selected by a kind-code tensor), so one graph serves every
kind, step and shape, and a call costs one compiled launch. Per-sample scalars come in as [B]
tensors, never Python floats (a float would be specialised into the graph). Float64 inputs
(gradcheck) run the same functions uncompiled.
"""

from __future__ import annotations

import functools

import torch

from grpo_kernels.sde_coefficients import logprob_affine, sde_coefficients
from grpo_kernels.validation import SDE_KINDS, step_params_ok


@functools.cache
def kind_codes(kind: str, reduction: str, device: torch.device) -> tuple[torch.Tensor, ...]:
    """0-d tensors (kind code, mean reduction?) passed to the kernels; cached, built once."""
    return (
        torch.tensor(SDE_KINDS.index(kind), device=device),
        torch.tensor(reduction == "mean", device=device),
    )


def step_coefficients(sigma, sigma_next, eta, sigma_max, kind_code, mean, numel):
    """(a, b, n, alpha, beta), each [B], for the kind selected by `kind_code`.

    m = a x + b v, x' = m + n eps, logp = alpha * sum((x' - m)^2) + beta. All kinds are
    evaluated on the [B] scalars and one is selected (the others' NaNs are discarded).
    """
    a = b = n = alpha = beta = None
    for code, kind in enumerate(SDE_KINDS):
        ka, kb, kn = sde_coefficients(sigma, sigma_next, eta, kind, sigma_max)
        kalpha, kbeta = logprob_affine(kn, kind, "sum", numel)
        if a is None:
            a, b, n, alpha, beta = ka, kb, kn, kalpha, kbeta
            continue
        pick = kind_code == code
        a, b, n = torch.where(pick, ka, a), torch.where(pick, kb, b), torch.where(pick, kn, n)
        alpha, beta = torch.where(pick, kalpha, alpha), torch.where(pick, kbeta, beta)
    # "mean" divides the summed log-density by the element count.
    alpha = torch.where(mean, alpha / numel, alpha)
    beta = torch.where(mean, beta / numel, beta)
    return a, b, n, alpha, beta


def _params_ok(sigma, sigma_next, eta, sigma_max, kind_code):
    return step_params_ok(
        sigma, sigma_next, eta, sigma_max, kind_code == SDE_KINDS.index("flow"),
        kind_code == SDE_KINDS.index("cps"),
    )


def _residual(x, v, x_next, a, b):
    """x' - m with m = a x + b v, in the coefficients' dtype (fp32 or fp64)."""
    dtype = a.dtype
    return x_next.to(dtype) - a[:, None] * x.to(dtype) - b[:, None] * v.to(dtype)


def logprob_forward(x, v, x_next, sigma, sigma_next, eta, sigma_max, kind_code, mean):
    """(logp [B], params_ok, coef [3, B] = (a, b, alpha) for the backward).

    logp[i] = alpha[i] * sum_k (x' - a x - b v)[i, k]^2 + beta[i]. Returning the coefficients
    also makes Inductor compute them once into a buffer instead of once per element.
    """
    a, b, _, alpha, beta = step_coefficients(
        sigma, sigma_next, eta, sigma_max, kind_code, mean, x.shape[1]
    )
    d = _residual(x, v, x_next, a, b)
    logp = alpha * (d * d).sum(dim=1) + beta
    ok = _params_ok(sigma, sigma_next, eta, sigma_max, kind_code)
    return logp, ok, torch.stack([a, b, alpha])


def logprob_backward(x, v, x_next, coef, grad_logp, want_x: bool, want_v: bool, want_next: bool):
    """Gradients of sum_i g[i] logp[i] from one read of the inputs, with s = 2 alpha g:
    d/dx' = s (x' - m), d/dx = -a s (x' - m), d/dv = -b s (x' - m)."""
    a, b, alpha = coef.unbind(0)
    scale = 2 * alpha * grad_logp.to(a.dtype)
    d = _residual(x, v, x_next, a, b)
    grad_x = ((-a * scale)[:, None] * d).to(x.dtype) if want_x else None
    grad_v = ((-b * scale)[:, None] * d).to(v.dtype) if want_v else None
    grad_next = (scale[:, None] * d).to(x_next.dtype) if want_next else None
    return grad_x, grad_v, grad_next


def sde_sample(x, v, noise, sigma, sigma_next, eta, sigma_max, kind_code, mean):
    """(x' = a x + b v + n eps in x's dtype, params_ok, coef [3, B] = (a, b, n))."""
    a, b, n, _, _ = step_coefficients(
        sigma, sigma_next, eta, sigma_max, kind_code, mean, x.shape[1]
    )
    dtype = a.dtype
    out = a[:, None] * x.to(dtype) + b[:, None] * v.to(dtype) + n[:, None] * noise.to(dtype)
    ok = _params_ok(sigma, sigma_next, eta, sigma_max, kind_code)
    return out.to(x.dtype), ok, torch.stack([a, b, n])


@functools.cache
def _compiled(fn):
    # dynamic=True: one graph per input dtype for every shape (batch 1 gets its own, as Dynamo
    # specialises sizes of 1). Past Dynamo's recompile limit a call runs eagerly: still right.
    return torch.compile(fn, dynamic=True)


def kernel(fn, dtype: torch.dtype):
    """The compiled kernel for fp32 compute; the plain function for float64 (gradcheck)."""
    return fn if dtype == torch.float64 else _compiled(fn)
