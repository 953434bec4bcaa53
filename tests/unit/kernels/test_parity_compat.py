"""grpo_kernels.compat against the golden outputs of the originals' own step functions
(Flow-GRPO's sde_step_with_logprob, Dance-GRPO's flux_step, GCPO's flow_grpo_step), run by
tools/make_parity_fixtures.py on the same fp32 arguments with a given prev_sample: log-probs and
the gradients of their sum with respect to the model output and the latents."""

from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from grpo_kernels import compat

GOLDEN = torch.load(Path(__file__).parents[2] / "fixtures" / "parity" / "compat.pt")
CASES = sorted(GOLDEN["cases"])


@pytest.mark.parametrize("case", CASES)
def test_adapter_matches_the_original(case):
    name, index = case.split("/")
    index = int(index)
    want = GOLDEN["cases"][case]
    x = GOLDEN["latents"].clone().requires_grad_()
    v = GOLDEN["model_output"].clone().requires_grad_()
    sigmas, eta, prev = GOLDEN["sigmas"], GOLDEN["eta"], want["prev_sample"]
    if name == "sde_step_with_logprob":
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        scheduler.set_timesteps(10)
        torch.testing.assert_close(scheduler.sigmas, sigmas, rtol=0, atol=0)
        timestep = scheduler.timesteps[[index] * x.shape[0]]
        log_prob = compat.sde_step_with_logprob(scheduler, v, timestep, x, noise_level=eta,
                                                prev_sample=prev)[1]
    elif name == "flux_step":
        log_prob = compat.flux_step(v, x, eta, sigmas, index, prev, grpo=True,
                                    sde_solver=True)[2]
    else:
        log_prob = compat.flow_grpo_step(v, x, eta, sigmas, index, prev)[2]
    grad_v, grad_x = torch.autograd.grad(log_prob.sum(), (v, x))
    torch.testing.assert_close(log_prob, want["log_prob"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_v, want["grad_model_output"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad_x, want["grad_latents"], rtol=1e-4, atol=1e-6)
