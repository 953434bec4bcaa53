"""A weighted mix of rewards, the one object the trainer scores with (a single reward is a mix of
one, with weight 1).

``build_reward("pickscore=1.0,clip=0.5", device="cuda", dtype=torch.bfloat16)`` builds each
reward of the spec (`chunk_grpo.config.reward_spec`), passing ``device=`` and ``dtype=`` to the
factories whose signature takes them. ``mix.score(images, prompts)`` returns every reward's checked
scores (`chunk_grpo.rewards.outputs`), in calls of at most ``batch_size`` images;
``mix.total(scores)`` is their weighted sum, and ``mix(images, prompts)`` both at once, so a mix is
itself a reward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from chunk_grpo.config.reward_spec import RewardSpecError, parse_reward_spec, reward_label
from chunk_grpo.rewards.outputs import call_reward, check_reward_output
from chunk_grpo.rewards.registry import Reward, reward_factory


@dataclass
class RewardComponent:
    name: str  # as the spec names it
    label: str  # metric-safe: reward/<label>_mean
    weight: float
    reward: Reward


def _keyword_options(factory: Callable, options: dict) -> dict:
    """The subset of ``options`` the factory's signature accepts (all with **kwargs)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: pass nothing
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(options)
    names = {p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return {k: v for k, v in options.items() if k in names}


class RewardMix:
    """Several rewards and their weights; calling it returns the weighted total [B]."""

    def __init__(self, components: list[RewardComponent], batch_size: int = 0):
        if not components:
            raise ValueError("a reward mix needs at least one reward")
        labels = [c.label for c in components]
        if len(set(labels)) != len(labels):
            raise RewardSpecError(f"rewards {[c.name for c in components]} give the same metric "
                                  f"label twice ({labels}); rename one of them")
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0 (0 = every image in one call), got "
                             f"{batch_size}")
        self.components = components
        self.batch_size = batch_size

    @property
    def labels(self) -> list[str]:
        return [c.label for c in self.components]

    @property
    def weights(self) -> dict[str, float]:
        return {c.label: c.weight for c in self.components}

    def check_prompts(self, prompts: list[str]) -> None:
        """Run the prompts through every component that can check them (e.g. the shapes
        grammar): a ValueError names the first a reward cannot score."""
        for c in self.components:
            checker = getattr(c.reward, "check_prompts", None)
            if checker is not None:
                checker(prompts)

    def _slices(self, n: int) -> list[slice]:
        step = self.batch_size or max(n, 1)
        return [slice(i, i + step) for i in range(0, n, step)] or [slice(0, 0)]

    @torch.no_grad()
    def score(self, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Each reward's scores, float32 CPU [B], by label (checked: a bad output or an
        exception in a reward is a RewardOutputError naming it)."""
        prompts = list(prompts)
        out = {}
        for c in self.components:
            parts = [call_reward(c.name, c.reward, images[s], prompts[s])
                     for s in self._slices(len(prompts))]
            out[c.label] = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out

    def total(self, scores: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The weighted sum of `score`'s result (a single reward of weight 1: its scores)."""
        if len(self.components) == 1 and self.components[0].weight == 1.0:
            return scores[self.components[0].label]
        return sum(c.weight * scores[c.label] for c in self.components)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return self.total(self.score(images, prompts))

    @torch.no_grad()
    def details(self, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Per-image "score" (the total) and, for a mix, each reward's scores by label; one
        reward with `details` of its own (e.g. shapes' accuracies) gives those."""
        prompts = list(prompts)
        single = self.components[0] if len(self.components) == 1 else None
        if single is not None and single.weight == 1.0 and hasattr(single.reward, "details"):
            parts = []
            for s in self._slices(len(prompts)):
                d = single.reward.details(images[s], prompts[s])
                d["score"] = check_reward_output(single.name, d.get("score"), len(prompts[s]))
                parts.append(d)
            return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        scores = self.score(images, prompts)
        out = {"score": self.total(scores)}
        if single is None:
            out.update(scores)
        return out


def build_reward(spec: str | Mapping, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, batch_size: int = 0) -> RewardMix:
    """The `RewardMix` of a reward spec (a name, ``module:name``, ``remote:URL``, or a weighted
    mix). ``device`` and ``dtype`` go to each factory that accepts them as keyword options."""
    options = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
    components = []
    for name, weight in parse_reward_spec(spec):
        factory, fixed = reward_factory(name)
        reward = factory(**fixed, **_keyword_options(factory, options))
        components.append(RewardComponent(name, reward_label(name), weight, reward))
    return RewardMix(components, batch_size=batch_size)


def check_reward_spec(spec: str | Mapping) -> None:
    """Resolve every name of a reward spec (importing "module:name" modules) without building a
    model: a misspelt reward is reported before anything heavy loads."""
    for name, _ in parse_reward_spec(spec):
        reward_factory(name)


def as_reward_mix(reward: Reward | RewardMix, name: str = "reward") -> RewardMix:
    """A reward object (e.g. one a caller built itself) as a mix of one, named ``name``."""
    if isinstance(reward, RewardMix):
        return reward
    return RewardMix([RewardComponent(name, reward_label(name), 1.0, reward)])
