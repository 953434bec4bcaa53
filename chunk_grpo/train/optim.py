"""Optimizer, learning-rate schedule and EMA of the trainable weights."""

from __future__ import annotations

import functools
import math

import torch


def build_optimizer(params: list, *, name: str, lr: float, betas: tuple[float, float],
                    eps: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW (fused kernel where the device has one) or bitsandbytes' 8-bit AdamW."""
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as err:
            raise ValueError("optimizer 'adamw8bit' needs bitsandbytes: pip install "
                             "bitsandbytes, or use optimizer: adamw") from err
        return bnb.optim.AdamW8bit(params, lr=lr, betas=betas, eps=eps,
                                   weight_decay=weight_decay)
    if name != "adamw":
        raise ValueError(f"optimizer must be 'adamw' or 'adamw8bit', got {name!r}")
    device = params[0].device
    fused = device.type in ("cuda", "cpu") and all(p.dtype == torch.float32 for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=fused or None)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int,
                       total_steps: int, kind: str) -> torch.optim.lr_scheduler.LambdaLR:
    fn = functools.partial(lr_factor, warmup_steps=warmup_steps, total_steps=total_steps,
                           kind=kind)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


class EMA:
    """Exponential moving average of parameters: shadow = d * shadow + (1 - d) * param."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], decay: float):
        self.decay = decay
        self.params = dict(named_params)
        self.shadow = {n: p.detach().float().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for name, p in self.params.items():
            self.shadow[name].lerp_(p.detach().float(), 1.0 - self.decay)

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the live weights and the averages (call twice to undo)."""
        for name, p in self.params.items():
            live = p.detach().clone()
            p.copy_(self.shadow[name].to(p.dtype))
            self.shadow[name] = live.float()

    def state_dict(self) -> dict:
        """The decay and the live averages (a checkpoint loads into them in place)."""
        return {"decay": self.decay, "shadow": self.shadow}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        for name, value in state["shadow"].items():
            if value is not self.shadow[name]:
                self.shadow[name].copy_(value)


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, kind: str = "constant") -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr schedule kind must be 'constant' or 'cosine', got {kind!r}")
