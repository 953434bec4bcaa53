"""Kernel calls that never touch the host: meta tensors and torch.compile(fullgraph=True).

A meta tensor has no data, so any read of its values on the host (.tolist(), .item(), bool(),
numpy) raises: with validate=False the whole dispatch, the argument checks and the coefficient
math must run on meta tensors. A graph break under fullgraph=True would be an error too.
"""

import pytest
import torch

import grpo_kernels as gk

META = torch.device("meta")


def _latents(device, shape=(3, 4, 5), requires_grad=False):
    g = torch.Generator().manual_seed(0)
    x, v, e = (torch.randn(shape, generator=g).to(device) for _ in range(3))
    return x, v.requires_grad_(requires_grad), e


def _steps(device):
    sigma = torch.tensor([1.0, 0.7, 0.4]).to(device)
    return sigma, (sigma - 0.1).to(device)


@pytest.mark.parametrize("backend", [None, "reference", "cpu_fused"])
@pytest.mark.parametrize("steps", ["tensors", "floats"])
def test_sde_step_logprob_and_sample_run_on_meta(backend, steps):
    x, v, noise = _latents(META, requires_grad=True)
    sigma, sigma_next = _steps(META) if steps == "tensors" else (0.7, 0.6)
    eta = torch.full((3,), 0.7, device=META) if steps == "tensors" else 0.7
    kwargs = dict(eta=eta, kind="flow", sigma_max=0.96, backend=backend, validate=False)
    logp = gk.sde_step_logprob(x, v, noise, sigma, sigma_next, **kwargs)
    assert logp.device == META and logp.shape == (3,) and logp.dtype == torch.float32
    (grad,) = torch.autograd.grad(logp.sum(), v)
    assert grad.device == META and grad.shape == v.shape
    x_next, logp = gk.sde_step_sample(x, v.detach(), noise, sigma, sigma_next, **kwargs)
    assert x_next.shape == x.shape and x_next.device == META and logp.shape == (3,)
    assert gk.ode_step(x, v, sigma, sigma_next, validate=False).device == META


@pytest.mark.parametrize("backend", [None, "reference", "cpu_fused"])
def test_chunk_grpo_loss_runs_on_meta(backend):
    logp_new = torch.randn(4, 6).to(META).requires_grad_()
    logp_old, advantages = torch.randn(4, 6).to(META), torch.randn(4).to(META)
    mask = torch.ones(4, 3, dtype=torch.bool).to(META)
    loss, stats = gk.chunk_grpo_loss(logp_new, logp_old, advantages, [1, 2, 3], chunk_mask=mask,
                                     clip_low=0.1, clip_high=0.2, kl_coef=0.1, backend=backend,
                                     validate=False)
    assert loss.device == META and loss.shape == ()
    assert stats["ratio_min"].device == META and stats["clip_frac_per_chunk"].shape == (3,)
    (grad,) = torch.autograd.grad(loss, logp_new)
    assert grad.shape == (4, 6)


def test_validation_reads_values_so_it_cannot_run_on_meta():
    # The meta tests above are meaningful: reading a value on the host does raise on meta.
    x, v, noise = _latents(META)
    sigma, sigma_next = _steps(META)
    with pytest.raises((NotImplementedError, RuntimeError)):
        gk.sde_step_logprob(x, v, noise, sigma, sigma_next, eta=0.7, sigma_max=0.96)
    with pytest.raises((NotImplementedError, RuntimeError)):
        gk.chunk_grpo_loss(torch.randn(2, 3).to(META), torch.randn(2, 3).to(META),
                           torch.randn(2).to(META), [3], chunk_mask=torch.ones(
                               2, 1, dtype=torch.bool).to(META), clip_low=0.1, clip_high=0.1)


def _step_and_loss(x, v, x_next, sigma, sigma_next, logp_old, advantages):
    logp = gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=0.7, kind="flow",
                               sigma_max=0.96, backend="reference", validate=False)
    steps = torch.stack([logp, 0.5 * logp, logp + 1.0], dim=1)  # [B, 3] per-step log-probs
    loss, stats = gk.chunk_grpo_loss(steps, logp_old, advantages, [1, 2], clip_low=0.2,
                                     clip_high=0.2, kl_coef=0.05, backend="reference",
                                     validate=False)
    return loss, stats["ratio_mean"], stats["clip_frac"]


@pytest.mark.slow  # Inductor's first compile: ~20 s on a quiet 2-core CPU, more under load
def test_compile_fullgraph_reference_backend_matches_eager():
    torch._dynamo.reset()
    x, v, x_next = _latents("cpu")
    sigma, sigma_next = _steps("cpu")
    logp_old = torch.randn(3, 3, generator=torch.Generator().manual_seed(1))
    advantages = torch.tensor([1.0, -0.5, 0.25])
    args = (x, v, x_next, sigma, sigma_next, logp_old, advantages)
    compiled = torch.compile(_step_and_loss, fullgraph=True)  # Inductor: C++ on the CPU
    got = compiled(*args)  # fullgraph=True: a graph break raises instead of splitting
    want = _step_and_loss(*args)
    for g, w in zip(got, want, strict=True):
        # Inductor fuses and reorders fp32 ops: equal up to fp32 rounding of |logp| ~ 1e2.
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
