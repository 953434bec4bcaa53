"""Fused GRPO kernels for flow-matching policies.

One function per op, dispatching by device: a Triton kernel on CUDA, a fused C kernel
on the CPU, or (`backend="reference"`) the plain torch reference; autograd with analytic
backward; nn.Module wrappers. The step coefficients are computed on the tensors' device; only
the value checks read back to the host, and `validate=False` skips them. Drop-in adapters for
Flow-GRPO, Dance-GRPO and GCPO live in `grpo_kernels.compat`. Depends only on torch (and
triton on CUDA, imported lazily).
"""

from grpo_kernels.functional import chunk_grpo_loss, ode_step, sde_step_logprob, sde_step_sample
from grpo_kernels.modules import ChunkGrpoLoss, SdeStepLogprob

__all__ = [
    "ChunkGrpoLoss",
    "SdeStepLogprob",
    "chunk_grpo_loss",
    "ode_step",
    "sde_step_logprob",
    "sde_step_sample",
]
