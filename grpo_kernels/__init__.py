"""Fused GRPO kernels for flow-matching policies.

One function per op (dispatching by device to a Triton kernel on CUDA, a fused compiled kernel
on the CPU, or the plain torch reference), autograd with analytic backward, nn.Module wrappers.
Depends only on torch (and triton on CUDA, imported lazily).
"""

from grpo_kernels.functional import chunk_grpo_loss, ode_step, sde_step_logprob, sde_step_sample

__all__ = ["chunk_grpo_loss", "ode_step", "sde_step_logprob", "sde_step_sample"]
