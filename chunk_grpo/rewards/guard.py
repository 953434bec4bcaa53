"""The guard: a second reward scored beside the trained one, to tell a real gain from reward
hacking (`eval.guard_reward`; by default the shapes world's checks on shapes prompts).

The guard never trains anything. It is scored on every iteration's rollouts (logged as
``guard/<name>_mean``), at every held-out evaluation on the same images as the trained reward
(paired before/after against the base, `chunk_grpo.train.summary.GuardComparison`), and in the
closing summary with a verdict. Scoring it leaves the run's random streams as they were
(`Guard.score`), so a run trains the same with or without a guard.

The early stop (`eval.guard_stop` = d > 0): at a periodic evaluation, the run stops when the
whole 95% CI of the guard's paired change against the base lies below -d, i.e. the guard fell
by more than d and the fall is beyond its noise (`stop_reason`).
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from chunk_grpo.rewards.mix import RewardMix


@dataclass
class Guard:
    """A guard reward, built from its spec."""

    spec: str  # as eval.guard_reward resolved it, e.g. "shapes"
    reward: RewardMix
    auto: bool = False  # chosen by eval.guard_reward: auto (not named by the user)
    on_rollouts: bool = True  # scored on the training rollouts (it accepts the train prompts)

    @property
    def name(self) -> str:
        """The metric label: the reward's (``shapes``), or ``mix`` for a weighted mix."""
        return self.reward.labels[0] if len(self.reward.components) == 1 else "mix"

    def score(self, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Per-image guard scores by label (a mix: each reward's, and "mix" their weighted
        total), float32 CPU; the random number generators are restored afterwards, so a guard
        that draws from them does not change the training that follows."""
        with rng_untouched():
            scores = self.reward.score(images.cpu(), list(prompts))
        if len(self.reward.components) > 1:
            scores["mix"] = self.reward.total(scores)
        return scores

    def metrics(self, scores: dict[str, torch.Tensor]) -> dict[str, float]:
        """``guard/<label>_mean`` and ``_std`` of (gathered) rollout scores."""
        out = {}
        for label, values in scores.items():
            finite = values[torch.isfinite(values)]
            out[f"guard/{label}_mean"] = float(finite.mean()) if finite.numel() else math.nan
            out[f"guard/{label}_std"] = float(finite.std()) if finite.numel() > 1 else math.nan
        return out


@contextlib.contextmanager
def rng_untouched() -> Iterator[None]:
    """Restore torch's (CPU and initialized CUDA devices'), NumPy's and Python's global random
    states on exit: what runs inside cannot shift the draws of what runs after it."""
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def stop_reason(name: str, gain: float, gain_ci95: float, n: int, threshold: float,
                step: int) -> str | None:
    """Why a run stops at the periodic evaluation of ``step``, or None to go on: the guard's
    paired change against the base (``gain`` +- ``gain_ci95`` over ``n`` images) lies, with its
    whole 95% CI, below -``threshold`` (`eval.guard_stop`; 0 never stops, nor does an unknown
    CI)."""
    if threshold <= 0 or not (math.isfinite(gain) and math.isfinite(gain_ci95)):
        return None
    low, high = gain - gain_ci95, gain + gain_ci95
    if high >= -threshold:
        return None
    return (f"guard {name} fell {-gain:.3f} below the base's at the evaluation of step {step} "
            f"({n} held-out images, 95% CI of the change {low:+.3f} .. {high:+.3f}, all below "
            f"-{threshold:g}: eval.guard_stop)")
