"""Fused CPU kernels: small torch functions that Inductor compiles into one C++ loop each.

Each reads the [B, N] latents once and never writes the SDE mean (or any other [B, N]
temporary). Float64 inputs (gradcheck) run the same functions uncompiled. Per-sample scalars
come in as [B] tensors, never Python floats, so one compiled graph serves every step.
"""

from __future__ import annotations

import functools

import torch


def residual_sumsq(
    x: torch.Tensor, v: torch.Tensor, x_next: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """S[i] = sum_k (x'[i,k] - a[i] x[i,k] - b[i] v[i,k])^2 over a [B, N] layout."""
    dtype = a.dtype
    d = x_next.to(dtype) - a[:, None] * x.to(dtype) - b[:, None] * v.to(dtype)
    return (d * d).sum(dim=1)


def residual_grad(
    x: torch.Tensor,
    v: torch.Tensor,
    x_next: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """scale[i] * (x' - a x - b v): the gradient of alpha*S w.r.t. one input, for that input's
    per-sample factor folded into `scale` (x': 2 alpha g; x: -2 alpha a g; v: -2 alpha b g)."""
    dtype = a.dtype
    d = x_next.to(dtype) - a[:, None] * x.to(dtype) - b[:, None] * v.to(dtype)
    return (scale[:, None] * d).to(out_dtype)


def sde_sample(
    x: torch.Tensor, v: torch.Tensor, noise: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    n: torch.Tensor,
) -> torch.Tensor:
    """x' = a x + b v + n eps, stored in x's dtype."""
    dtype = a.dtype
    out = a[:, None] * x.to(dtype) + b[:, None] * v.to(dtype) + n[:, None] * noise.to(dtype)
    return out.to(x.dtype)


@functools.cache
def _compiled(fn):
    # dynamic=True: one graph for every batch size and latent size (no recompiles per shape).
    return torch.compile(fn, dynamic=True, fullgraph=True)


def kernel(fn, dtype: torch.dtype):
    """The compiled kernel for fp32/bf16/fp16 compute; plain eager for float64 (gradcheck)."""
    return fn if dtype == torch.float64 else _compiled(fn)
