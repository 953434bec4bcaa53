"""Triton kernels (CUDA; tested on the CPU under TRITON_INTERPRET=1). Imported lazily.

Latents arrive as [B, N] with unit column stride; per-sample coefficients a, b, n, alpha, beta
(sde_coefficients.py) as [B] fp32 tensors. Every load is cast to fp32 before any math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 1024


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Unit stride along N (a copy only for exotic layouts); the row stride is passed on."""
    return t if t.stride(1) == 1 else t.contiguous()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


@triton.jit
def _sde_logprob_fwd(
    # data
    X, V, X_NEXT, A, B, PARTIAL,
    # shapes and strides
    N, stride_x, stride_v, stride_xn, num_blocks,
    # constants
    BLOCK: tl.constexpr,
):
    # One program per (sample, block of N): partial sum of (x' - a x - b v)^2.
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a = tl.load(A + row).to(tl.float32)
    b = tl.load(B + row).to(tl.float32)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + row * stride_v + offs, mask=mask, other=0.0).to(tl.float32)
    xn = tl.load(X_NEXT + row * stride_xn + offs, mask=mask, other=0.0).to(tl.float32)
    d = xn - a * x - b * v  # masked lanes: 0 - 0 - 0
    tl.store(PARTIAL + row * num_blocks + blk, tl.sum(d * d, axis=0))


@triton.jit
def _sde_logprob_bwd(
    # data
    X, V, X_NEXT, A, B, SCALE, GX, GV, GXN,
    # shapes and strides
    N, stride_x, stride_v, stride_xn,
    # constants: which gradients to write
    WANT_X: tl.constexpr, WANT_V: tl.constexpr, WANT_NEXT: tl.constexpr, BLOCK: tl.constexpr,
):
    # Recompute the residual and write each requested gradient: scale * {-a, -b, 1} * d.
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a = tl.load(A + row).to(tl.float32)
    b = tl.load(B + row).to(tl.float32)
    s = tl.load(SCALE + row).to(tl.float32)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + row * stride_v + offs, mask=mask, other=0.0).to(tl.float32)
    xn = tl.load(X_NEXT + row * stride_xn + offs, mask=mask, other=0.0).to(tl.float32)
    sd = s * (xn - a * x - b * v)
    if WANT_X:
        tl.store(GX + row * N + offs, (-a * sd).to(GX.dtype.element_ty), mask=mask)
    if WANT_V:
        tl.store(GV + row * N + offs, (-b * sd).to(GV.dtype.element_ty), mask=mask)
    if WANT_NEXT:
        tl.store(GXN + row * N + offs, sd.to(GXN.dtype.element_ty), mask=mask)


@triton.jit
def _sde_sample(
    # data
    X, V, NOISE, A, B, SCALE_N, OUT,
    # shapes and strides
    N, stride_x, stride_v, stride_e,
    # constants
    BLOCK: tl.constexpr,
):
    # x' = a x + b v + n eps, stored in the output's dtype.
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a = tl.load(A + row).to(tl.float32)
    b = tl.load(B + row).to(tl.float32)
    n = tl.load(SCALE_N + row).to(tl.float32)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + row * stride_v + offs, mask=mask, other=0.0).to(tl.float32)
    e = tl.load(NOISE + row * stride_e + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * N + offs, (a * x + b * v + n * e).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_loss_fwd(
    # data
    DELTA, ADV, CHUNK_ID, SIZES, RATIO, LOSS, GRAD_LOG_RATIO, KL,
    # shapes
    S, K,
    # constants
    clip_low, clip_high,
    BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # One program per sample: chunk log-ratios as a masked [K, S] segment mean, then the
    # PPO-clip terms per chunk. The log-ratio sums exact zeros when delta == 0, so r == 1.0.
    row = tl.program_id(0)
    steps = tl.arange(0, BLOCK_S)
    chunks = tl.arange(0, BLOCK_K)
    step_ok = steps < S
    chunk_ok = chunks < K
    delta = tl.load(DELTA + row * S + steps, mask=step_ok, other=0.0).to(tl.float32)
    cid = tl.load(CHUNK_ID + steps, mask=step_ok, other=-1)
    size = tl.load(SIZES + chunks, mask=chunk_ok, other=1.0).to(tl.float32)
    adv = tl.load(ADV + row).to(tl.float32)
    member = cid[None, :] == chunks[:, None]  # [BLOCK_K, BLOCK_S]
    log_ratio = tl.sum(tl.where(member, delta[None, :], 0.0), axis=1) / size
    ratio = tl.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
    take_unclipped = unclipped >= clipped
    k3 = tl.exp(-delta) + delta - 1.0
    kl = tl.sum(tl.where(member, k3[None, :], 0.0), axis=1) / size
    out = row * K + chunks
    tl.store(RATIO + out, ratio, mask=chunk_ok)
    tl.store(LOSS + out, tl.where(take_unclipped, unclipped, clipped), mask=chunk_ok)
    tl.store(GRAD_LOG_RATIO + out, tl.where(take_unclipped, unclipped, 0.0), mask=chunk_ok)
    tl.store(KL + out, kl, mask=chunk_ok)


def _grid(batch: int, numel: int) -> tuple[int, int]:
    return (batch, triton.cdiv(numel, BLOCK_N))


def sde_logprob_fwd(x, v, x_next, a, b, alpha, beta):
    """logp [B] = alpha * S + beta, S reduced from per-block partial sums (deterministic)."""
    x, v, x_next = _rows(x), _rows(v), _rows(x_next)
    batch, numel = x.shape
    grid = _grid(batch, numel)
    partial = torch.empty(grid, dtype=torch.float32, device=x.device)
    _sde_logprob_fwd[grid](
        x, v, x_next, _f32(a), _f32(b), partial,
        numel, x.stride(0), v.stride(0), x_next.stride(0), grid[1],
        BLOCK=BLOCK_N,
    )
    return alpha * partial.sum(dim=1).to(alpha.dtype) + beta


def sde_logprob_bwd(x, v, x_next, a, b, scale, want_x, want_v, want_next):
    x, v, x_next = _rows(x), _rows(v), _rows(x_next)
    batch, numel = x.shape
    outs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) if want else None
            for t, want in ((x, want_x), (v, want_v), (x_next, want_next))]
    placeholder = x  # never written: its WANT_* flag is off
    gx, gv, gxn = (o if o is not None else placeholder for o in outs)
    _sde_logprob_bwd[_grid(batch, numel)](
        x, v, x_next, _f32(a), _f32(b), _f32(scale), gx, gv, gxn,
        numel, x.stride(0), v.stride(0), x_next.stride(0),
        WANT_X=want_x, WANT_V=want_v, WANT_NEXT=want_next, BLOCK=BLOCK_N,
    )
    return tuple(outs)


def sde_sample(x, v, noise, a, b, n):
    x, v, noise = _rows(x), _rows(v), _rows(noise)
    batch, numel = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _sde_sample[_grid(batch, numel)](
        x, v, noise, _f32(a), _f32(b), _f32(n), out,
        numel, x.stride(0), v.stride(0), noise.stride(0),
        BLOCK=BLOCK_N,
    )
    return out


def chunk_terms(delta, advantages, chunk_sizes, clip_low, clip_high):
    """(ratio, loss, d loss / d log-ratio, mean k3), each [B, K] fp32; see chunk_terms_torch."""
    batch, steps = delta.shape
    num_chunks = len(chunk_sizes)
    device = delta.device
    chunk_id = torch.repeat_interleave(
        torch.arange(num_chunks, dtype=torch.int32, device=device),
        torch.tensor(chunk_sizes, device=device),
    )
    sizes = torch.tensor(chunk_sizes, dtype=torch.float32, device=device)
    outs = [torch.empty(batch, num_chunks, dtype=torch.float32, device=device) for _ in range(4)]
    _chunk_loss_fwd[(batch,)](
        _f32(delta), _f32(advantages), chunk_id, sizes, *outs,
        steps, num_chunks, float(clip_low), float(clip_high),
        BLOCK_S=triton.next_power_of_2(steps), BLOCK_K=triton.next_power_of_2(num_chunks),
    )
    return tuple(o.to(delta.dtype) for o in outs)
