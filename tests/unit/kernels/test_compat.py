"""grpo_kernels.compat against docs/math.md's formulas, written out here (no kernel call), in each
project's return conventions: Flow-GRPO, Dance-GRPO, GCPO."""

import math
import types

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from grpo_kernels import compat

ETA = 0.7


def _view(t, like):
    return t.reshape(-1, *([1] * (like.dim() - 1)))


def flow_mean_and_std(x, v, s, s_next, eta, s_max):
    """docs/math.md `flow`: std = eta sqrt(s / (1 - s)) (s_1 in the denominator at s == 1)."""
    s, s_next = _view(s, x), _view(s_next, x)
    dt = s_next - s
    std = eta * torch.sqrt(s / (1 - torch.where(s == 1, torch.as_tensor(s_max), s)))
    mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
    return mean, std, std * torch.sqrt(-dt)


def dance_mean(x, v, s, s_next, eta):
    """docs/math.md `dance`: m = x + dt v + (-0.5 eta^2 score) dt, score from x0 = x - s v."""
    dt = s_next - s
    x0 = x - s * v
    score = -(x - (1 - s) * x0) / s**2
    return x + dt * v + (-0.5 * eta**2 * score) * dt


def gaussian_logp(x_next, mean, n):
    """Mean over all but the batch dim of the full Gaussian log-density."""
    logp = -((x_next - mean) ** 2) / (2 * n**2) - torch.log(n) - 0.5 * math.log(2 * math.pi)
    return logp.mean(dim=tuple(range(1, logp.dim())))


def _latents(shape=(3, 8, 4), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(3))


def _scheduler():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    return scheduler


@pytest.mark.parametrize("given", [True, False], ids=["prev_sample", "sampled"])
def test_flow_grpo_sde_step_with_logprob(given):
    scheduler = _scheduler()
    timestep = scheduler.timesteps[[0, 3, 7]]  # the first step has sigma == 1: sigma_max
    x, v, e = _latents()
    v = v.requires_grad_()
    steps = [scheduler.index_for_timestep(t) for t in timestep]
    s, s_next = scheduler.sigmas[steps], scheduler.sigmas[[i + 1 for i in steps]]
    assert s[0] == 1.0
    mean, std, n = flow_mean_and_std(x, v, s, s_next, ETA, scheduler.sigmas[1])
    if given:
        prev = (mean + n * e).detach().bfloat16()  # stored in bf16: cast to fp32 as there
        out = compat.sde_step_with_logprob(scheduler, v, timestep, x, noise_level=ETA,
                                           prev_sample=prev)
        want_prev = prev.float()
    else:
        out = compat.sde_step_with_logprob(scheduler, v, timestep, x, noise_level=ETA,
                                           generator=torch.Generator().manual_seed(5))
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
        want_prev = (mean + n * noise).detach()
    prev_sample, log_prob, prev_mean, std_dev_t = out
    assert log_prob.shape == (3,) and log_prob.dtype == torch.float32
    assert std_dev_t.shape == (3, 1, 1) and prev_sample.dtype == torch.float32
    torch.testing.assert_close(prev_sample, want_prev, rtol=1e-5, atol=1e-5)
    want = gaussian_logp(want_prev, mean, n)
    torch.testing.assert_close(log_prob, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(prev_mean, mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(std_dev_t, std, rtol=1e-5, atol=1e-6)
    # Gradients reach the velocity through the log-prob and the mean, as in the original.
    got = torch.autograd.grad(log_prob.sum() + prev_mean.sum(), v)[0]
    ref = torch.autograd.grad(want.sum() + mean.sum(), v)[0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_flow_grpo_cps_and_sqrt_dt():
    scheduler = _scheduler()
    timestep = scheduler.timesteps[[2, 5]]
    x, v, e = (t[:2] for t in _latents())
    steps = [scheduler.index_for_timestep(t) for t in timestep]
    s, s_next = (_view(scheduler.sigmas[idx], x) for idx in
                 (steps, [i + 1 for i in steps]))
    # docs/math.md `cps`: n = s' sin(eta pi / 2), m = (1 - s') x0 + sqrt(s'^2 - n^2) x1.
    n = s_next * math.sin(ETA * math.pi / 2)
    mean = (1 - s_next) * (x - s * v) + torch.sqrt(s_next**2 - n**2) * (x + (1 - s) * v)
    prev = mean + n * e
    out = compat.sde_step_with_logprob(scheduler, v, timestep, x, noise_level=ETA,
                                       prev_sample=prev, sde_type="cps", return_sqrt_dt=True)
    _, log_prob, prev_mean, std_dev_t, sqrt_dt = out
    # The public CPS code drops the constants and 1 / (2 n^2): -mean((x' - m)^2).
    torch.testing.assert_close(log_prob, -((prev - mean) ** 2).mean(dim=(1, 2)), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(prev_mean, mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(std_dev_t, n, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sqrt_dt, torch.sqrt(s - s_next), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="sde_type must be"):
        compat.sde_step_with_logprob(scheduler, v, timestep, x, sde_type="ode")


def _schedule():
    return 3 * torch.linspace(1, 0, 11) / (1 + 2 * torch.linspace(1, 0, 11))  # shift 3


@pytest.mark.parametrize("given", [True, False], ids=["prev_sample", "sampled"])
def test_dance_grpo_flux_step(given):
    sigmas, index = _schedule(), 4
    s, s_next = sigmas[index], sigmas[index + 1]
    x, v, e = _latents(seed=1)
    mean = dance_mean(x, v, s, s_next, ETA)
    n = ETA * math.sqrt(s - s_next)
    if given:
        prev = mean + n * e
        got = compat.flux_step(v, x, ETA, sigmas, index, prev, grpo=True, sde_solver=True)
    else:
        torch.manual_seed(11)  # Dance-GRPO draws from the global generator (randn_like)
        got = compat.flux_step(v, x, ETA, sigmas, index, None, grpo=True, sde_solver=True)
        torch.manual_seed(11)
        prev = mean + n * torch.randn_like(mean)
    prev_sample, pred_original, log_prob = got
    torch.testing.assert_close(prev_sample, prev, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pred_original, x - s * v)
    # Dance-GRPO's log_prob: the full Gaussian log-density (constants included), mean-reduced.
    want = gaussian_logp(prev, mean, torch.as_tensor(n))
    assert log_prob.shape == (3,) and log_prob.dtype == torch.float32
    torch.testing.assert_close(log_prob, want, rtol=1e-5, atol=2e-5)


def test_dance_grpo_flux_step_without_grpo_and_the_unsupported_mode():
    sigmas, index = _schedule(), 2
    s, s_next = sigmas[index], sigmas[index + 1]
    x, v, _ = _latents(seed=2)
    mean, x0 = compat.flux_step(v, x, ETA, sigmas, index, None, grpo=False, sde_solver=True)
    torch.testing.assert_close(mean, dance_mean(x, v, s, s_next, ETA), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x0, x - s * v)
    mean, _ = compat.flux_step(v, x, ETA, sigmas, index, None, grpo=False, sde_solver=False)
    torch.testing.assert_close(mean, x + (s_next - s) * v)
    with pytest.raises(ValueError, match="sde_solver=False"):
        compat.flux_step(v, x, ETA, sigmas, index, None, grpo=True, sde_solver=False)


@pytest.mark.parametrize("given", [True, False], ids=["prev_sample", "sampled"])
def test_gcpo_flow_grpo_step(given):
    sigmas, index = _schedule(), 0  # sigma == 1 on the first step: sigmas[1] as sigma_max
    x, v, e = _latents(seed=3)
    v = v.bfloat16()  # the transformer's output; latents stay fp32 as in GCPO's loop
    mean, _, n = flow_mean_and_std(x, v.float(), sigmas[index:index + 1],
                                   sigmas[index + 1:index + 2], ETA, sigmas[1])
    if given:
        prev = mean + n * e
        got = compat.flow_grpo_step(v, x, ETA, sigmas, index, prev)
    else:
        got = compat.flow_grpo_step(v, x, ETA, sigmas, index, None,
                                    generator=torch.Generator().manual_seed(3))
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(3),
                            dtype=torch.bfloat16)  # drawn in model_output's dtype
        prev = mean + n * noise.float()
    prev_sample, pred_original, log_prob = got
    assert prev_sample.dtype == torch.float32 and log_prob.shape == (3,)
    torch.testing.assert_close(prev_sample, prev, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(pred_original, x - sigmas[index] * v)
    torch.testing.assert_close(log_prob, gaussian_logp(prev, mean, n), rtol=1e-5, atol=1e-4)


def test_apply_grpo_kernels_replaces_the_step_functions():
    def flux_step(*args):  # a training script's own step function
        raise AssertionError("not replaced")

    script = types.ModuleType("train_grpo_flux")
    script.flux_step, script.other = flux_step, 1
    assert compat.apply_grpo_kernels(script) == ["flux_step"]
    assert script.flux_step is compat.flux_step and script.other == 1
    with pytest.raises(ValueError, match="defines none of"):
        compat.apply_grpo_kernels(types.ModuleType("empty"))
