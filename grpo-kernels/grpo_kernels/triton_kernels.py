"""Triton kernels (CUDA; tested on the CPU under TRITON_INTERPRET=1). Imported lazily.

The backend calling convention of autograd.py: latents [B, ...] (flattened to [B, N] with unit
column stride), the step as StepParams. Each kernel computes its row's coefficients itself from
the step's parameters on the device (`_coefficients`: the expressions of sde_coefficients.py,
in fp32), so no call reads anything back to the host. Every load is cast to fp32 before math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo_kernels.step_params import StepParams

BLOCK_N = 1024
BLOCK_P = 128  # partial sums of one row reduced per iteration of the finishing kernel
KINDS = {"flow": 0, "dance": 1, "cps": 2, "cps_mse": 3}


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [B, N] with unit stride along N (a copy only for exotic layouts)."""
    t = t.reshape(t.shape[0], -1)
    return t if t.stride(1) == 1 else t.contiguous()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def _step_tensors(step: StepParams, device: torch.device) -> list:
    """Each parameter as (tensor, stride): a float becomes a 0-d device tensor (torch.full: a
    fill kernel, no host-to-device copy), read with stride 0 by every row."""
    out = []
    for value in step:
        if not isinstance(value, torch.Tensor):
            value = torch.full((), value, dtype=torch.float32, device=device)
        out += [value, value.stride(0) if value.dim() else 0]
    return out[0::2] + out[1::2]  # four tensors, then their four strides


@triton.jit
def _coefficients(SIGMA, SIGMA_NEXT, ETA, SIGMA_MAX, s_sigma, s_next, s_eta, s_max, row,
                  KIND: tl.constexpr):
    # The row's (a, b, n): mean m = a x + b v, sample x' = m + n eps (sde_coefficients.py).
    s = tl.load(SIGMA + row * s_sigma).to(tl.float32)
    sn = tl.load(SIGMA_NEXT + row * s_next).to(tl.float32)
    eta = tl.load(ETA + row * s_eta).to(tl.float32)
    dt = sn - s
    if KIND == 0:  # flow: at s == 1 the schedule's s_1 replaces s in the denominator
        s_max = tl.load(SIGMA_MAX + row * s_max).to(tl.float32)
        std = eta * tl.sqrt(s / (1.0 - tl.where(s == 1.0, s_max, s)))
        a = 1.0 + std * std / (2.0 * s) * dt
        b = (1.0 + std * std * (1.0 - s) / (2.0 * s)) * dt
        n = std * tl.sqrt(-dt)
    elif KIND == 1:  # dance
        drift = 0.5 * eta * eta * dt / s
        a = 1.0 + drift
        b = dt + drift * (1.0 - s)
        n = eta * tl.sqrt(-dt)
    else:  # cps, cps_mse
        n = sn * tl.sin(eta * 1.5707963267948966)
        c = tl.sqrt(sn * sn - n * n)
        a = (1.0 - sn) + c
        b = -(1.0 - sn) * s + c * (1.0 - s)
    return a, b, n


@triton.jit
def _affine(n, numel, KIND: tl.constexpr, MEAN: tl.constexpr):
    # (alpha, beta): logp = alpha * sum (x' - m)^2 + beta over the row's numel elements.
    if KIND == 3:  # cps_mse: the public CPS code drops the constants and 1 / (2 n^2)
        alpha = -1.0 + 0.0 * n
        beta = 0.0 * n
    else:
        alpha = -1.0 / (2.0 * n * n)
        beta = -tl.log(n) - 0.9189385332046727  # 0.5 * log(2 pi)
    if MEAN:
        alpha = alpha / numel
    else:
        beta = beta * numel
    return alpha, beta


@triton.jit
def _sde_logprob_fwd(
    # data
    X, V, X_NEXT, PARTIAL,
    # step parameters and their row strides
    SIGMA, SIGMA_NEXT, ETA, SIGMA_MAX, s_sigma, s_next, s_eta, s_max,
    # shapes and strides
    N, stride_x, stride_v, stride_xn, num_blocks,
    # constants
    KIND: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per (sample, block of N): partial sum of (x' - a x - b v)^2.
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a, b, n = _coefficients(SIGMA, SIGMA_NEXT, ETA, SIGMA_MAX, s_sigma, s_next, s_eta, s_max,
                            row, KIND)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + row * stride_v + offs, mask=mask, other=0.0).to(tl.float32)
    xn = tl.load(X_NEXT + row * stride_xn + offs, mask=mask, other=0.0).to(tl.float32)
    d = xn - a * x - b * v  # masked lanes: 0 - 0 - 0
    tl.store(PARTIAL + row * num_blocks + blk, tl.sum(d * d, axis=0))


@triton.jit
def _sde_logprob_finish(
    # data
    PARTIAL, LOGP,
    # step parameters and their row strides
    SIGMA, SIGMA_NEXT, ETA, SIGMA_MAX, s_sigma, s_next, s_eta, s_max,
    # shapes
    N, num_blocks,
    # constants
    KIND: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per sample: logp = alpha * (sum of the row's partials, in order) + beta.
    row = tl.program_id(0)
    total = 0.0
    for start in range(0, num_blocks, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        part = tl.load(PARTIAL + row * num_blocks + offs, mask=offs < num_blocks, other=0.0)
        total += tl.sum(part.to(tl.float32), axis=0)
    _, _, n = _coefficients(SIGMA, SIGMA_NEXT, ETA, SIGMA_MAX, s_sigma, s_next, s_eta, s_max,
                            row, KIND)
    alpha, beta = _affine(n, N, KIND, MEAN)
    tl.store(LOGP + row, alpha * total + beta)


@triton.jit
def _sde_logprob_bwd(
    # data
    X, V, X_NEXT, G, GX, GV, GXN,
    # step parameters and their row strides
    SIGMA, SIGMA_NEXT, ETA, SIGMA_MAX, s_sigma, s_next, s_eta, s_max,
    # shapes and strides
    N, stride_x, stride_v, stride_xn, stride_g,
    # constants: the kind, the reduction, which gradients to write
    KIND: tl.constexpr, MEAN: tl.constexpr, WANT_X: tl.constexpr, WANT_V: tl.constexpr,
    WANT_NEXT: tl.constexpr, BLOCK: tl.constexpr,
):
    # Recompute the residual and write each requested gradient: scale * {-a, -b, 1} * d with
    # scale = 2 alpha g (d logp / d x' = 2 alpha (x' - m)).
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a, b, n = _coefficients(SIGMA, SIGMA_NEXT, ETA, SIGMA_MAX, s_sigma, s_next, s_eta, s_max,
                            row, KIND)
    alpha, _ = _affine(n, N, KIND, MEAN)
    s = 2.0 * alpha * tl.load(G + row * stride_g).to(tl.float32)
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
    X, V, NOISE, OUT,
    # step parameters and their row strides
    SIGMA, SIGMA_NEXT, ETA, SIGMA_MAX, s_sigma, s_next, s_eta, s_max,
    # shapes and strides
    N, stride_x, stride_v, stride_e,
    # constants
    KIND: tl.constexpr, BLOCK: tl.constexpr,
):
    # x' = a x + b v + n eps, stored in the output's dtype.
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a, b, n = _coefficients(SIGMA, SIGMA_NEXT, ETA, SIGMA_MAX, s_sigma, s_next, s_eta, s_max,
                            row, KIND)
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


def sde_logprob_fwd(x, v, x_next, step: StepParams, kind: str, reduction: str):
    """logp [B] fp32: per-block partial sums of (x' - m)^2, then one finishing program per row
    (deterministic: the partials are added in block order)."""
    x, v, x_next = _rows(x), _rows(v), _rows(x_next)
    batch, numel = x.shape
    grid = _grid(batch, numel)
    params = _step_tensors(step, x.device)
    partial = torch.empty(grid, dtype=torch.float32, device=x.device)
    _sde_logprob_fwd[grid](
        x, v, x_next, partial, *params,
        numel, x.stride(0), v.stride(0), x_next.stride(0), grid[1],
        KIND=KINDS[kind], BLOCK=BLOCK_N,
    )
    logp = torch.empty(batch, dtype=torch.float32, device=x.device)
    _sde_logprob_finish[(batch,)](
        partial, logp, *params, numel, grid[1],
        KIND=KINDS[kind], MEAN=reduction == "mean", BLOCK=BLOCK_P,
    )
    return logp


def sde_logprob_bwd(x, v, x_next, step: StepParams, kind: str, reduction: str, grad_logp,
                    want_x: bool, want_v: bool, want_next: bool):
    like = (x, v, x_next)
    x, v, x_next = _rows(x), _rows(v), _rows(x_next)
    batch, numel = x.shape
    outs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) if want else None
            for t, want in ((x, want_x), (v, want_v), (x_next, want_next))]
    placeholder = x  # never written: its WANT_* flag is off
    gx, gv, gxn = (o if o is not None else placeholder for o in outs)
    _sde_logprob_bwd[_grid(batch, numel)](
        x, v, x_next, grad_logp, gx, gv, gxn, *_step_tensors(step, x.device),
        numel, x.stride(0), v.stride(0), x_next.stride(0), grad_logp.stride(0),
        KIND=KINDS[kind], MEAN=reduction == "mean", WANT_X=want_x, WANT_V=want_v,
        WANT_NEXT=want_next, BLOCK=BLOCK_N,
    )
    return tuple(None if g is None else g.reshape(t.shape)
                 for g, t in zip(outs, like, strict=True))


def sde_sample(x, v, noise, step: StepParams, kind: str):
    shape = x.shape
    x, v, noise = _rows(x), _rows(v), _rows(noise)
    batch, numel = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _sde_sample[_grid(batch, numel)](
        x, v, noise, out, *_step_tensors(step, x.device),
        numel, x.stride(0), v.stride(0), noise.stride(0),
        KIND=KINDS[kind], BLOCK=BLOCK_N,
    )
    return out.reshape(shape)


def chunk_terms(delta, advantages, chunk_id, sizes, clip_low, clip_high):
    """(ratio, loss, d loss / d log-ratio, mean k3), each [B, K]; see cpu_fused.chunk_terms."""
    batch, steps = delta.shape
    num_chunks = sizes.shape[0]
    device = delta.device
    outs = [torch.empty(batch, num_chunks, dtype=torch.float32, device=device) for _ in range(4)]
    _chunk_loss_fwd[(batch,)](
        _f32(delta), _f32(advantages), chunk_id, sizes, *outs,
        steps, num_chunks, float(clip_low), float(clip_high),
        BLOCK_S=triton.next_power_of_2(steps), BLOCK_K=triton.next_power_of_2(num_chunks),
    )
    return tuple(o.to(delta.dtype) for o in outs)
