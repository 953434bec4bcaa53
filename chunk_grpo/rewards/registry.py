"""Rewards by name: `register_reward("name")` on a factory, `get_reward("name", **kwargs)`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class Reward(Protocol):
    """Scores images against their prompts: images [B, 3, H, W] in [0, 1] -> float32 [B] (CPU)."""

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor: ...


_FACTORIES: dict[str, Callable[..., Reward]] = {}


def register_reward(name: str) -> Callable[[Callable[..., Reward]], Callable[..., Reward]]:
    """Decorator registering a reward factory (a class or function taking keyword options)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty str, got {name!r}")

    def decorate(factory: Callable[..., Reward]) -> Callable[..., Reward]:
        if name in _FACTORIES and _FACTORIES[name] is not factory:
            raise ValueError(f"a reward named {name!r} is already registered; pick another name")
        _FACTORIES[name] = factory
        return factory

    return decorate


def available_rewards() -> list[str]:
    return sorted(_FACTORIES)


def get_reward(name: str, **kwargs) -> Reward:
    """A new instance of the reward registered as `name`, built with `kwargs`."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown reward {name!r}; available: {available_rewards()}")
    return _FACTORIES[name](**kwargs)
