"""Scoring rollouts with the run's reward mix: overlapped with sampling, checked before a run.

`RolloutScorer` is `rollout.sample_rollouts`' ``on_batch`` hook: rollout batch i is scored on one
worker thread while the main thread samples batch i+1 (without overlap: every batch after
sampling) (torch releases the GIL inside its
kernels, and a remote reward waits on a socket), so only the last batch's scoring is left once
sampling ends. Scores do not depend on the overlap: each batch is scored whole, in order, by the
same calls. `probe_reward` calls the rewards once on a small batch before a run starts;
`constant_within_groups` tells a reward that gives a group no learning signal.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from chunk_grpo.rewards.mix import RewardMix
from chunk_grpo.rewards.outputs import RewardError, RewardOutputError


class RolloutScorer:
    """Scores rollout batches as they come on a worker thread (``overlap``), or all after
    sampling; `collect` returns every reward's scores for all rows, in row order. Use as a
    context manager."""

    def __init__(self, reward: RewardMix, overlap: bool = True):
        self.reward = reward
        self.executor = ThreadPoolExecutor(1, "reward") if overlap else None
        self.parts: list[Future | tuple[torch.Tensor, list[str]]] = []
        self.busy_seconds = 0.0  # time spent inside the reward calls

    def score_now(self, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Every reward's scores of ``images``, on this thread (counted in busy_seconds)."""
        start = time.perf_counter()
        scores = self.reward.score(images.cpu(), prompts)
        self.busy_seconds += time.perf_counter() - start
        return scores

    def __call__(self, images: torch.Tensor, prompts: list[str], index: int) -> None:
        if self.executor is None:  # scored in `collect`, after sampling
            self.parts.append((images, prompts))
            return
        for part in self.parts:  # a failed batch stops the rollout now, not after sampling
            if isinstance(part, Future) and part.done() and part.exception() is not None:
                part.result()
        self.parts.append(self.executor.submit(self.score_now, images, prompts))

    def collect(self) -> dict[str, torch.Tensor]:
        """Every reward's scores [rows], float32 CPU, by label (waits for the worker)."""
        parts = [p.result() if isinstance(p, Future) else self.score_now(*p) for p in self.parts]
        if not parts:
            raise ValueError("no rollout batch was scored")
        return {label: parts[0][label] if len(parts) == 1 else torch.cat([p[label] for p in parts])
                for label in parts[0]}

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> RolloutScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def probe_reward(reward: RewardMix, height: int, width: int, prompts: list[str],
                 n: int = 2) -> dict[str, torch.Tensor]:
    """Score ``n`` fixed random images of the model's size with the first training prompts,
    so that a reward that fails or returns the wrong thing stops the run before it starts.
    Draws from its own generator: the run's random streams are untouched."""
    if not prompts:
        raise ValueError("probe_reward needs at least one prompt")
    images = torch.rand(n, 3, height, width, generator=torch.Generator().manual_seed(0))
    probe_prompts = [prompts[i % len(prompts)] for i in range(n)]
    try:
        scores = reward.score(images, probe_prompts)
    except RewardError as err:
        raise type(err)(f"checking the reward before training ({n} images of {height}x{width}): "
                        f"{err}") from err
    for label, values in scores.items():
        if not bool(torch.isfinite(values).all()):
            raise RewardOutputError(
                f"checking the reward before training ({n} images of {height}x{width}): "
                f"reward {label!r} returned NaN/Inf scores {values.tolist()}; a run would skip "
                "every iteration it does so and train nothing: fix the reward")
    return scores


def constant_within_groups(rewards: torch.Tensor, group_size: int) -> bool:
    """Whether every group of ``group_size`` consecutive rewards is constant (zero advantage
    for every image, whatever the normalisation)."""
    r = rewards.view(-1, group_size)
    return bool((r.amax(dim=1) == r.amin(dim=1)).all())
