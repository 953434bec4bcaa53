"""nn.Module wrappers holding an op's fixed settings; forward calls the functional API.

The settings are checked when the module is built, so a bad one fails at construction with
the same message the functional call would give, not at the first forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from grpo_kernels.functional import chunk_grpo_loss, sde_step_logprob
from grpo_kernels.validation import (
    check_backend,
    check_chunk_settings,
    check_sde_kind,
    check_step_scalars,
)


class SdeStepLogprob(nn.Module):
    """Per-sample SDE step log-prob: `SdeStepLogprob(eta=0.7)(x, v, x_next, s, s_next)`."""

    def __init__(
        self,
        *,
        eta: float,
        kind: str = "flow",
        sigma_max: float | None = None,
        reduction: str = "mean",
        backend: str | None = None,
        validate: bool = True,
    ) -> None:
        super().__init__()
        check_sde_kind(kind, reduction)
        check_step_scalars(eta, sigma_max)
        check_backend(backend)
        self.eta, self.kind, self.sigma_max = eta, kind, sigma_max
        self.reduction, self.backend, self.validate = reduction, backend, validate

    def forward(self, x, v, x_next, sigma, sigma_next) -> torch.Tensor:
        return sde_step_logprob(
            x, v, x_next, sigma, sigma_next, eta=self.eta, kind=self.kind,
            sigma_max=self.sigma_max, reduction=self.reduction, backend=self.backend,
            validate=self.validate,
        )

    def extra_repr(self) -> str:
        return f"eta={self.eta}, kind={self.kind!r}, reduction={self.reduction!r}"


class ChunkGrpoLoss(nn.Module):
    """Chunk-level PPO-clip GRPO loss over fixed chunk sizes; forward returns (loss, stats)."""

    def __init__(
        self,
        chunk_sizes: Sequence[int],
        *,
        clip_low: float,
        clip_high: float,
        adv_clip_max: float | None = None,
        kl_coef: float = 0.0,
        backend: str | None = None,
        validate: bool = True,
    ) -> None:
        super().__init__()
        check_chunk_settings(chunk_sizes, clip_low, clip_high, adv_clip_max, kl_coef)
        check_backend(backend)
        self.validate = validate
        self.chunk_sizes = [int(c) for c in chunk_sizes]
        self.clip_low, self.clip_high = clip_low, clip_high
        self.adv_clip_max, self.kl_coef, self.backend = adv_clip_max, kl_coef, backend

    def forward(self, logp_new, logp_old, advantages, chunk_mask=None):
        return chunk_grpo_loss(
            logp_new, logp_old, advantages, self.chunk_sizes, chunk_mask=chunk_mask,
            clip_low=self.clip_low, clip_high=self.clip_high, adv_clip_max=self.adv_clip_max,
            kl_coef=self.kl_coef, backend=self.backend, validate=self.validate,
        )

    def extra_repr(self) -> str:
        return f"chunk_sizes={self.chunk_sizes}, clip=({self.clip_low}, {self.clip_high})"
