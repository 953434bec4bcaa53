"""The noise schedule: the shifted flow-matching sigmas (the learning-rate schedule is
`chunk_grpo.train.optim.lr_factor`)."""

from __future__ import annotations

import math

import torch


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """shift * s / (1 + (shift - 1) * s): spends more steps at high noise for shift > 1."""
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def flux_sigmas(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """Sigmas 1 -> 0 for ``num_steps`` steps: linspace(1, 0, T + 1), then shifted. float32."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift_sigmas(sigmas, shift).to(torch.float32)


def dynamic_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                  base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """FLUX's resolution-dependent shift: exp(mu), mu linear in the latent token count."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    mu = base_shift + slope * (image_seq_len - base_seq_len)
    return math.exp(mu)
