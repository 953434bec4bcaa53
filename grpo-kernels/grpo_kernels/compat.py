"""Drop-in adapters: the SDE step functions of Flow-GRPO, Dance-GRPO and GCPO, through grpo_kernels.

Each function has the signature and the return values of the public function it replaces, so a
training script changes one import (or calls `apply_grpo_kernels(module)`, in the spirit of
Liger-Kernel's apply_liger_kernel_to_*). The sample and its log-prob come from the fused
kernels (`sde_step_sample` / `sde_step_logprob`: the SDE mean is never stored, backward is
analytic); values that the original returns besides them (the mean, x0, the std) are computed
with plain torch ops, differentiable like the original's.

Conventions kept from each project (read from its public code; written here independently):
- Flow-GRPO `sde_step_with_logprob` (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py):
  everything in fp32; sde_type "sde" is kind "flow" with sigma_max = scheduler.sigmas[1],
  log_prob = MEAN over all but the batch dim of the full Gaussian log-density; sde_type "cps"
  is kind "cps_mse", log_prob = -mean((x' - m)^2). Returns (prev_sample, log_prob [B],
  prev_sample_mean, std_dev_t [B, 1, ...]) and sqrt(-dt) [B, 1, ...] with return_sqrt_dt.
  std_dev_t is eta * sqrt(s / (1 - s)) for "sde" (without the sqrt(-dt) factor), s' sin(eta
  pi / 2) for "cps". The noise is drawn in fp32 from `generator` (diffusers' randn_tensor).
- Dance-GRPO `flux_step` (fastvideo/train_grpo_flux.py): kind "dance"; its log_prob is the
  MEAN over all but the batch dim of the full Gaussian log-density, -(x' - m)^2 / (2 std^2)
  - log(std) - log(sqrt(2 pi)) with std = eta sqrt(sigma - sigma_next), computed in fp32.
  Noise from the global generator (torch.randn_like of the mean).
  Returns (prev_sample, pred_original_sample, log_prob) with grpo=True, (prev_sample_mean,
  pred_original_sample) with grpo=False. grpo=True with sde_solver=False (a density around the
  ODE mean) is no grpo_kernels kind and raises.
- GCPO `flow_grpo_step` (xingzhejun/GCPO, fastvideo/train_grpo_flux_*.py): Flow-GRPO's step
  (kind "flow", sigma_max = sigmas[1], full log-density, mean reduction) in the style of
  flux_step: returns (prev_sample, pred_original_sample, log_prob); noise drawn in
  model_output's dtype from `generator`; `grpo` and `sde_solver` are accepted and unused, as
  there.
Differences: a sampled prev_sample is detached (the originals let it carry the mean's graph;
their log-probs detach it anyway), and log-probs are computed in fp32 whatever the input dtype.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from grpo_kernels.functional import sde_step_logprob, sde_step_sample
from grpo_kernels.reference import sde_mean_and_noise_reference
from grpo_kernels.step_params import step_rows


def randn_like_diffusers(shape, generator, device, dtype) -> torch.Tensor:
    """Standard normal noise as diffusers' randn_tensor draws it: on the generator's device
    then moved; a list of generators draws one sample each."""
    if isinstance(generator, (list, tuple)):
        draws = [torch.randn((1, *shape[1:]), generator=g, device=g.device, dtype=dtype)
                 for g in generator]
        return torch.cat(draws).to(device)
    where = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=where, dtype=dtype).to(device)


def _mean_and_noise_scale(x, v, sigma, sigma_next, eta, kind, sigma_max):
    """The step's mean m [B, ...] and noise scale n [B, 1, ...] in fp32, differentiable."""
    batch, device = x.shape[0], x.device
    rows = [step_rows(p, batch, torch.float32, device)
            for p in (sigma, sigma_next, eta, math.nan if sigma_max is None else sigma_max)]
    return sde_mean_and_noise_reference(x.float(), v.float(), *rows, kind)


def _per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *([1] * (like.dim() - 1)))


def sde_step_with_logprob(
    self,
    model_output: torch.Tensor,
    timestep: torch.Tensor,
    sample: torch.Tensor,
    noise_level: float = 0.7,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    sde_type: str = "sde",
    return_sqrt_dt: bool = False,
):
    """Flow-GRPO's scheduler step (`self`: a FlowMatchEulerDiscreteScheduler) with log-prob."""
    if sde_type not in ("sde", "cps"):
        raise ValueError(f"sde_type must be 'sde' or 'cps', got {sde_type!r}")
    model_output, sample = model_output.float(), sample.float()
    device = sample.device
    step_index = [self.index_for_timestep(t) for t in timestep]
    sigma = self.sigmas[step_index].to(device=device, dtype=torch.float32)
    sigma_next = self.sigmas[[i + 1 for i in step_index]].to(device=device, dtype=torch.float32)
    sigma_max = self.sigmas[1].to(device=device, dtype=torch.float32)
    kind = "flow" if sde_type == "sde" else "cps_mse"
    kwargs = dict(eta=noise_level, kind=kind, sigma_max=sigma_max)
    if prev_sample is None:
        noise = randn_like_diffusers(model_output.shape, generator, device, torch.float32)
        prev_sample, log_prob = sde_step_sample(sample, model_output, noise, sigma, sigma_next,
                                                **kwargs)
    else:
        prev_sample = prev_sample.float()
        log_prob = sde_step_logprob(sample, model_output, prev_sample.detach(), sigma,
                                    sigma_next, **kwargs)
    mean, scale = _mean_and_noise_scale(sample, model_output, sigma, sigma_next, noise_level,
                                        kind, sigma_max)
    sqrt_dt = torch.sqrt(_per_sample(sigma - sigma_next, sample))
    std_dev_t = scale / sqrt_dt if sde_type == "sde" else scale  # cps: s' sin(eta pi / 2)
    if return_sqrt_dt:
        return prev_sample, log_prob, mean, std_dev_t, sqrt_dt
    return prev_sample, log_prob, mean, std_dev_t


def _two_sigmas(sigmas: torch.Tensor, index: int, device: torch.device):
    return sigmas[index].to(device), sigmas[index + 1].to(device)


def flux_step(
    model_output: torch.Tensor,
    latents: torch.Tensor,
    eta: float,
    sigmas: torch.Tensor,
    index: int,
    prev_sample: torch.Tensor | None,
    grpo: bool,
    sde_solver: bool,
):
    """Dance-GRPO's FLUX step: (prev_sample, pred_original_sample, log_prob) with grpo=True."""
    sigma, sigma_next = _two_sigmas(sigmas, index, latents.device)
    pred_original_sample = latents - sigma * model_output
    if not grpo:
        if sde_solver:
            mean = _mean_and_noise_scale(latents, model_output, sigma, sigma_next, eta,
                                         "dance", None)[0]
        else:
            mean = latents + (sigma_next - sigma) * model_output
        return mean, pred_original_sample
    if not sde_solver:
        raise ValueError(
            "flux_step(grpo=True, sde_solver=False) (a log-prob around the ODE mean) has no "
            "grpo_kernels kind; use sde_solver=True, or Dance-GRPO's own flux_step for it"
        )
    kwargs = dict(eta=eta, kind="dance")
    if prev_sample is None:
        dtype = torch.promote_types(latents.dtype, model_output.dtype)
        noise = torch.randn(latents.shape, dtype=dtype, device=latents.device)
        prev_sample, log_prob = sde_step_sample(latents.to(dtype), model_output, noise, sigma,
                                                sigma_next, **kwargs)
    else:
        log_prob = sde_step_logprob(latents, model_output, prev_sample.detach(), sigma,
                                    sigma_next, **kwargs)
    return prev_sample, pred_original_sample, log_prob


def flow_grpo_step(
    model_output: torch.Tensor,
    latents: torch.Tensor,
    eta: float,
    sigmas: torch.Tensor,
    index: int,
    prev_sample: torch.Tensor | None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    grpo: bool = True,
    sde_solver: bool = True,
):
    """GCPO's Flow-GRPO step: (prev_sample, pred_original_sample, log_prob)."""
    device = latents.device
    sigma, sigma_next = _two_sigmas(sigmas, index, device)
    kwargs = dict(eta=eta, kind="flow", sigma_max=sigmas[1].to(device))
    pred_original_sample = latents - sigma * model_output
    if prev_sample is None:
        noise = randn_like_diffusers(model_output.shape, generator, device, model_output.dtype)
        dtype = torch.promote_types(latents.dtype, model_output.dtype)
        prev_sample, log_prob = sde_step_sample(latents.to(dtype), model_output, noise, sigma,
                                                sigma_next, **kwargs)
    else:
        log_prob = sde_step_logprob(latents, model_output, prev_sample.detach(), sigma,
                                    sigma_next, **kwargs)
    return prev_sample, pred_original_sample, log_prob


ADAPTERS = {
    "sde_step_with_logprob": sde_step_with_logprob,
    "flux_step": flux_step,
    "flow_grpo_step": flow_grpo_step,
}


def apply_grpo_kernels(module: ModuleType | object) -> list[str]:
    """Replace, on `module` (a training script's module, or any object holding these names),
    each of sde_step_with_logprob / flux_step / flow_grpo_step it defines by its adapter.
    Returns the names replaced; a module defining none of them is an error."""
    names = [name for name in ADAPTERS if hasattr(module, name)]
    if not names:
        raise ValueError(
            f"{getattr(module, '__name__', module)!r} defines none of {sorted(ADAPTERS)}; "
            "pass the module whose step function the training loop calls"
        )
    for name in names:
        setattr(module, name, ADAPTERS[name])
    return names
