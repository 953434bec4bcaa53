"""Fused CPU kernels: small torch functions that Inductor compiles into one C++ loop each.

Each reads the [B, N] latents once and never writes the SDE mean (or any other [B, N]
temporary). The per-sample coefficients (sde_coefficients.py) come in as [B] tensors, never
Python floats, so one compiled graph serves every kind, step and batch size. Float64 inputs
(gradcheck) run the same functions uncompiled.
"""

from __future__ import annotations

import functools

import torch


def _residual(x, v, x_next, a, b):
    """x' - m with m = a x + b v, in the coefficients' dtype (fp32 or fp64)."""
    dtype = a.dtype
    return x_next.to(dtype) - a[:, None] * x.to(dtype) - b[:, None] * v.to(dtype)


def logprob_forward(x, v, x_next, a, b, alpha, beta):
    """logp[i] = alpha[i] * sum_k (x' - a x - b v)[i, k]^2 + beta[i] over a [B, N] layout."""
    d = _residual(x, v, x_next, a, b)
    return alpha * (d * d).sum(dim=1) + beta


def logprob_backward(x, v, x_next, a, b, scale, want_x: bool, want_v: bool, want_next: bool):
    """Gradients of sum_i g[i] logp[i] from one read of the inputs, with scale = 2 alpha g:
    d/dx' = scale (x' - m), d/dx = -a scale (x' - m), d/dv = -b scale (x' - m)."""
    d = _residual(x, v, x_next, a, b)
    grad_x = ((-a * scale)[:, None] * d).to(x.dtype) if want_x else None
    grad_v = ((-b * scale)[:, None] * d).to(v.dtype) if want_v else None
    grad_next = (scale[:, None] * d).to(x_next.dtype) if want_next else None
    return grad_x, grad_v, grad_next


def sde_sample(x, v, noise, a, b, n):
    """x' = a x + b v + n eps, stored in x's dtype."""
    dtype = a.dtype
    out = a[:, None] * x.to(dtype) + b[:, None] * v.to(dtype) + n[:, None] * noise.to(dtype)
    return out.to(x.dtype)


@functools.cache
def _compiled(fn):
    # dynamic=True: one graph per input dtype for every shape (batch 1 gets its own, as Dynamo
    # specialises sizes of 1). Past Dynamo's recompile limit a call runs eagerly: still right.
    return torch.compile(fn, dynamic=True)


def kernel(fn, dtype: torch.dtype):
    """The compiled kernel for fp32 compute; the plain function for float64 (gradcheck)."""
    return fn if dtype == torch.float64 else _compiled(fn)
