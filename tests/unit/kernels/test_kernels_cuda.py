"""The compiled Triton kernels on a CUDA GPU against the torch reference, at FLUX shapes.

Marked `cuda`; skipped without a GPU, and under TRITON_INTERPRET=1 (tests/conftest.py sets it
unless the environment says otherwise), where the interpreter, not the compiled code, would run:

    TRITON_INTERPRET=0 python -m pytest -m cuda tests/unit/kernels/test_kernels_cuda.py

(`python -m chunk_grpo.gpu_check` runs exactly that.) Every result is compared three ways, as
flash-attention's and Liger's tests do: the kernel, torch's reference in the same dtype, and
the reference in fp64 on the same inputs (bf16 and fp32 values are exact in fp64): the truth.

Tolerances, and why they are what they are:
- fp32 results (log-probs, fp32 gradients and samples, the chunk loss and its gradient): the
  kernel's largest error against the truth is at most twice torch's own fp32 error plus
  FP32_ULPS units in the last place of the largest value. The compiled PTX computes the step's
  coefficients with approximate sqrt and division (sqrt.approx, div.full: within 2 ulp) and
  exp/log through ex2.approx/lg2.approx, contracts a*x + b*v into FMAs, and sums a row in its
  own order (a tree within each 1024-element block, the blocks in order): each costs a few ulp
  of the result, where a wrong index, stride or formula costs orders of magnitude more.
- bf16 outputs (gradients and samples of bf16 latents): within 1 bf16 ulp of torch's bf16
  result, beyond the fp32 error of the value both round. Both compute in fp32 and round once;
  on sm_80+ the kernel's conversion rounds to nearest as torch's does (the interpreter
  truncates), so two fp32 values a few ulp apart can round to neighbouring bf16 values, never
  further apart.
"""

from __future__ import annotations

import os

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.functional import resolve_backend

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1 runs the interpreter, not the compiled kernels; "
                              "run with TRITON_INTERPRET=0"),
]

KINDS = ["flow", "dance", "cps", "cps_mse"]
SIGMA_MAX = 0.96
ETA = 0.7
FP32_ULPS = 16
ADV_CLIP = 5.0
LOGP_TERMS = {"logp": 1.0}  # mean reduction: -log n - 0.92 and -mean(d^2) / (2 n^2) are O(1)
MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7}
# FLUX latents: 4096 tokens x 64 channels at 1024px, 2025 at 720px; batch rows 1..24 (a chunk
# of up to 7 steps x a micro-batch, a group of 12, two groups); then shapes whose row length is
# no multiple of the 1024-element block, or shorter than one.
LATENT_SHAPES = [(1, 4096, 64), (7, 2025, 64), (12, 4096, 64), (24, 2025, 64),
                 (3, 1000, 3), (5, 1, 1025), (2, 1, 1)]
_ids = lambda s: "x".join(map(str, s))  # noqa: E731


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |x| (elementwise, in fp64)."""
    x = x.double().abs().clamp_min(torch.finfo(dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(x)) - MANTISSA_BITS[dtype])


def _scale(truth: torch.Tensor, terms: float) -> torch.Tensor:
    """The magnitude whose ulp bounds rounding: the result's, or that of the terms it was
    computed from when they cancel (a log-prob's log n and mean square, the k3 estimate's
    exp(-d) + d - 1, the loss's -A r: ``terms``)."""
    return torch.clamp_min(truth.abs().max(), terms)


def assert_fp32_close(got, ref32, truth, name, terms=0.0):
    """At most twice torch's fp32 error against the truth, plus FP32_ULPS of its scale."""
    err = (got.double() - truth).abs().max().item()
    ref_err = (ref32.double() - truth).abs().max().item()
    tol = 2 * ref_err + FP32_ULPS * ulp(_scale(truth, terms), torch.float32).item()
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g} (torch fp32's: {ref_err:.3g})"


def assert_bf16_close(got, ref_bf16, ref32, truth, name, terms=0.0):
    """Within 1 bf16 ulp of torch's bf16 result, beyond the fp32 error of what both round
    (``ref32``: torch's unrounded fp32 result)."""
    assert got.dtype == ref_bf16.dtype == torch.bfloat16, name
    fp32_err = (3 * (ref32.double() - truth).abs().max()
                + FP32_ULPS * ulp(_scale(truth, terms), torch.float32))
    diff = (got.double() - ref_bf16.double()).abs()
    tol = ulp(torch.maximum(got.abs(), ref_bf16.abs()), torch.bfloat16) + fp32_err
    bad = diff > tol
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.numel()} elements beyond 1 bf16 ulp, e.g. "
            f"flat index {i}: kernel {got.flatten()[i].item()!r}, torch "
            f"{ref_bf16.flatten()[i].item()!r}")


def _steps(batch, device, dtype=torch.float32):
    """Per-sample steps, the first at sigma == 1 (flow's sigma_max case)."""
    g = torch.Generator().manual_seed(1)
    sigma = torch.linspace(1.0, 0.3, batch) if batch > 1 else torch.tensor([0.7])
    sigma_next = sigma - 0.04 - 0.02 * torch.rand(batch, generator=g)
    return sigma.to(device, dtype), sigma_next.to(device, dtype)


def _latents(shape, dtype, kind, layout="contiguous", seed=0):
    """(x, v, x_next, noise) on the GPU in ``dtype``; x_next sampled from the step itself (in
    fp64), so x_next - m is the small noise term a rollout leaves, as in training."""
    g = torch.Generator().manual_seed(seed)
    x, v, e = (torch.randn(shape, generator=g, dtype=torch.float64).cuda() for _ in range(3))
    sigma, sigma_next = _steps(shape[0], "cuda", torch.float64)
    x_next, _ = gk.sde_step_sample(x, v, e, sigma, sigma_next, eta=ETA, kind=kind,
                                   sigma_max=SIGMA_MAX, backend="reference")
    out = [t.to(dtype) for t in (x, v, x_next, e)]
    if layout == "row-strided":  # rows apart in a wider buffer: the kernels' stride arguments
        out = [_row_strided(t) for t in out]
    elif layout == "transposed":  # channels-first storage seen as [B, N, C]: copied to rows
        out = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in out]
    return out


def _row_strided(t: torch.Tensor, pad: int = 7) -> torch.Tensor:
    """``t`` as rows of a [B, N + pad] buffer: each row contiguous, row stride N + pad."""
    buffer = torch.zeros(t.shape[0], t[0].numel() + pad, dtype=t.dtype, device=t.device)
    buffer[:, :t[0].numel()] = t.flatten(1)
    return buffer[:, :t[0].numel()].unflatten(1, t.shape[1:])


def _logprob_and_grads(x, v, x_next, kind, backend, reduction="mean"):
    x, v, x_next = (t.detach().requires_grad_() for t in (x, v, x_next))
    sigma, sigma_next = _steps(x.shape[0], x.device,
                               torch.float64 if x.dtype == torch.float64 else torch.float32)
    logp = gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=ETA, kind=kind,
                               sigma_max=SIGMA_MAX, reduction=reduction, backend=backend)
    weights = torch.linspace(0.5, 1.5, logp.shape[0], dtype=logp.dtype, device=logp.device)
    grads = torch.autograd.grad((logp * weights).sum(), (x, v, x_next))
    return (logp.detach(), *grads)


def _check_three_ways(inputs, run, names, terms=None):
    """The kernel against torch in the same dtype and the fp64 truth, per output (``terms``:
    the magnitude of the terms of outputs that are sums, by name)."""
    terms = terms or {}
    dtype = inputs[0].dtype
    got = run(*inputs, backend="triton")
    same = run(*inputs, backend="reference")
    ref32 = run(*(t.float() for t in inputs), backend="reference")
    truth = run(*(t.double() for t in inputs), backend="reference")
    for name, g, s, r, t in zip(names, got, same, ref32, truth, strict=True):
        assert g.shape == t.shape and g.dtype == s.dtype, name
        if g.dtype == torch.bfloat16:
            assert_bf16_close(g, s, r, t, f"{name} ({dtype})", terms.get(name, 0.0))
        else:
            assert_fp32_close(g, r, t, f"{name} ({dtype})", terms.get(name, 0.0))


def test_cuda_tensors_default_to_the_compiled_triton_backend():
    assert resolve_backend(None, torch.device("cuda")) == "triton"


@pytest.mark.parametrize("shape", LATENT_SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_logprob_forward_and_backward(kind, dtype, shape):
    inputs = _latents(shape, dtype, kind)
    _check_three_ways(inputs[:3], lambda *a, backend: _logprob_and_grads(*a, kind, backend),
                      ["logp", "grad_x", "grad_v", "grad_x_next"], LOGP_TERMS)


@pytest.mark.parametrize("layout", ["row-strided", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logprob_non_contiguous_latents(dtype, layout):
    inputs = _latents((7, 2025, 64), dtype, "flow", layout)
    assert not inputs[0].is_contiguous()
    _check_three_ways(inputs[:3], lambda *a, backend: _logprob_and_grads(*a, "flow", backend),
                      ["logp", "grad_x", "grad_v", "grad_x_next"], LOGP_TERMS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logprob_sum_reduction(dtype):
    inputs = _latents((12, 4096, 64), dtype, "dance")
    _check_three_ways(
        inputs[:3], lambda *a, backend: _logprob_and_grads(*a, "dance", backend, "sum"),
        ["logp", "grad_x", "grad_v", "grad_x_next"])


def _sample(x, v, noise, kind, backend):
    sigma, sigma_next = _steps(x.shape[0], x.device,
                               torch.float64 if x.dtype == torch.float64 else torch.float32)
    return gk.sde_step_sample(x, v, noise, sigma, sigma_next, eta=ETA, kind=kind,
                              sigma_max=SIGMA_MAX, backend=backend)


@pytest.mark.parametrize("shape", [(7, 2025, 64), (24, 4096, 64), (3, 1000, 3)], ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_sample(kind, dtype, shape):
    x, v, _, noise = _latents(shape, dtype, kind)
    # x_next only: the log-prob each backend returns is of its own x_next (in bf16 one ulp
    # apart here and there), and the log-prob kernel is checked above.
    _check_three_ways([x, v, noise], lambda *a, backend: _sample(*a, kind, backend)[:1],
                      ["x_next"])
    # The rollout's log-prob is the training call's, bit for bit, on the compiled kernels too:
    # a policy that has not moved gets a ratio of exactly 1.
    x_next, logp = _sample(x, v, noise, kind, "triton")
    sigma, sigma_next = _steps(shape[0], "cuda")
    again = gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=ETA, kind=kind,
                                sigma_max=SIGMA_MAX, backend="triton")
    assert torch.equal(logp, again)


def _loss_and_grad(logp_new, logp_old, advantages, sizes, mask, kl_coef, clip, backend):
    logp_new = logp_new.detach().requires_grad_()
    loss, stats = gk.chunk_grpo_loss(logp_new, logp_old, advantages, sizes, chunk_mask=mask,
                                     clip_low=clip, clip_high=clip, adv_clip_max=ADV_CLIP,
                                     kl_coef=kl_coef, backend=backend)
    (grad,) = torch.autograd.grad(loss, logp_new)
    return loss.detach(), grad, stats["ratio_mean"], stats["approx_kl"], stats["policy_loss"]


# (rows, chunk sizes, kl_coef, clip): the preset (2, 3, 4, 7 over 16 trained steps, clip 5e-5)
# for one micro-batch, a group and eight groups; 17 step-level chunks; one sequence-level chunk.
LOSS_CASES = [(1, [2, 3, 4, 7], 0.0, 5e-5), (24, [2, 3, 4, 7], 0.0, 5e-5),
              (96, [2, 3, 4, 7], 0.01, 0.02), (12, [1] * 17, 0.1, 0.2), (5, [9], 0.0, 0.02)]


@pytest.mark.parametrize("rows, sizes, kl_coef, clip", LOSS_CASES,
                         ids=[f"{r}rows-{len(s)}chunks-kl{k}-clip{c}" for r, s, k, c in LOSS_CASES])
def test_chunk_loss_forward_and_backward(rows, sizes, kl_coef, clip):
    g = torch.Generator().manual_seed(0)
    steps = sum(sizes)
    logp_old = torch.randn(rows, steps, generator=g).cuda()
    logp_new = logp_old + 0.05 * torch.randn(rows, steps, generator=g).cuda()
    advantages = torch.randn(rows, generator=g).cuda()
    mask = (torch.rand(rows, len(sizes), generator=g) > 0.3).cuda()
    mask[0, 0] = True

    def run(new, old, adv, backend):
        return _loss_and_grad(new, old, adv, sizes, mask, kl_coef, clip, backend)

    _check_three_ways([logp_new, logp_old, advantages], run,
                      ["loss", "grad_logp_new", "ratio_mean", "approx_kl", "policy_loss"],
                      {"loss": ADV_CLIP, "policy_loss": ADV_CLIP, "approx_kl": 1.0,
                       "ratio_mean": 1.0})


def test_chunk_loss_ratio_is_exactly_one_when_the_policy_has_not_moved():
    logp = torch.randn(24, 16, generator=torch.Generator().manual_seed(0)).cuda()
    advantages = torch.linspace(-2, 2, 24, device="cuda")
    _, stats = gk.chunk_grpo_loss(logp, logp.clone(), advantages, [2, 3, 4, 7], clip_low=1e-4,
                                  clip_high=1e-4, backend="triton")
    assert stats["ratio_min"].item() == stats["ratio_max"].item() == 1.0
    assert stats["clip_frac"].item() == 0.0
