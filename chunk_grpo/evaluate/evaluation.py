"""Evaluating a policy: sample images for a prompt list, score them, the mean with a 95% CI.

`evaluate_policy` is what `python -m chunk_grpo.evaluate` (the CLI, which also writes the
outputs) and the trainer's periodic evaluation both run; `EvalResult` holds the images, the
rewards, a guard reward's scores of the same images, per-attribute accuracies and best-of-k.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from chunk_grpo.algorithm.rollout import generate
from chunk_grpo.evaluate.stats import best_of_k, mean_ci95
from chunk_grpo.rewards import Reward, build_reward


@dataclass
class EvalResult:
    reward_mean: float
    reward_ci95: float  # half-width of the 95% confidence interval of the mean
    n: int
    rewards: torch.Tensor  # [n] float32
    prompts: list[str]  # [n], the prompt of each image
    images: torch.Tensor  # [n, 3, H, W] in [0, 1]
    attributes: dict[str, float] = field(default_factory=dict)  # e.g. colour_acc, exact
    sampling_seconds: float = math.nan  # wall time of generate()
    images_per_prompt: int = 1  # images are prompt-major: prompt i owns rows i*N .. i*N+N-1
    guard_scores: torch.Tensor | None = None  # [n] float32: the guard reward's, if one was given

    def best_of(self) -> dict[int, tuple[float, float]]:
        """k -> (mean over prompts of the expected best of k images, its 95% CI half-width),
        for k = 2, 4, 8, .. and N itself; empty for one image per prompt."""
        n = self.images_per_prompt
        if n == 1:
            return {}
        ks = sorted({2**i for i in range(1, n.bit_length())} | {n})
        per_prompt = self.rewards.reshape(-1, n).numpy()
        return {k: mean_ci95(best_of_k(per_prompt, k)) for k in ks}

    def metrics(self) -> dict:
        return {
            "reward_mean": self.reward_mean,
            "reward_ci95": self.reward_ci95,
            "n": self.n,
            "sampling_seconds": self.sampling_seconds,
            **self.attributes,
            **{f"best_of_{k}": {"mean": m, "ci95": c} for k, (m, c) in self.best_of().items()},
        }


@torch.no_grad()
def evaluate_policy(
    policy,
    prompts: list[str],
    *,
    reward: str | Reward = "shapes",
    num_steps: int | None = None,
    shift: float | None = None,
    sampler: str = "ode",
    eta: float = 0.0,
    cfg_scale: float | None = None,
    seed: int = 0,
    index_offset: int = 0,
    images_per_prompt: int = 1,
    batch_size: int = 64,
    hybrid_base=None,
    hybrid_steps: int = 0,
    progress: bool = False,
    guard: Reward | None = None,
) -> EvalResult:
    """Sample `images_per_prompt` images per prompt with `chunk_grpo.algorithm.rollout.generate` and
    score them. num_steps/shift default to the model's sampling defaults; the same seed gives the
    same images. Image i (prompt-major: prompts[i // images_per_prompt]) has the noise of global
    image ``index_offset`` + i, so ranks that each evaluate a slice of a prompt list, with the
    slice's first global image index, sample between them the images one process would.

    ``guard``: a second reward scored on the same images (per image in ``guard_scores``), e.g.
    the shapes reward's GenEval-like checks beside a learned reward: it tells prompt fidelity
    kept from reward hacking. Attributes (per-attribute accuracies) come from the reward's own
    `details` when it has them; the guard's `details` (its checks, and its mean score as
    ``fidelity_score``) join them unless they are the reward's own."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    if images_per_prompt < 1:
        raise ValueError(f"images_per_prompt must be >= 1, got {images_per_prompt}")
    scorer = build_reward(reward) if isinstance(reward, str) else reward
    defaults = getattr(policy, "defaults", None)
    num_steps = num_steps if num_steps is not None else getattr(defaults, "num_steps", 16)
    shift = shift if shift is not None else getattr(defaults, "shift", 3.0)
    all_prompts = [p for p in prompts for _ in range(images_per_prompt)]
    start = time.perf_counter()
    images = generate(policy, all_prompts, num_steps=num_steps, shift=shift, sampler=sampler,
                      eta=eta, cfg_scale=cfg_scale, seed=seed, index_offset=index_offset,
                      batch_size=batch_size,
                      hybrid_base=hybrid_base, hybrid_steps=hybrid_steps,
                      progress=progress).cpu()
    seconds = time.perf_counter() - start
    if hasattr(scorer, "details"):
        details = scorer.details(images, all_prompts)
        rewards = details.pop("score")
    else:
        rewards = scorer(images, all_prompts)
        details = {}
    guard_scores = None
    if guard is not None:
        if hasattr(guard, "details"):
            checks = guard.details(images, all_prompts)
            guard_scores = checks.pop("score")
            checks["fidelity_score"] = guard_scores
            own = set(checks) - {"fidelity_score"}
            if not own or not own <= set(details):  # not the trained reward's own checks
                details.update(checks)
        else:
            guard_scores = guard(images, all_prompts)
        guard_scores = torch.as_tensor(guard_scores).float().cpu()
    attributes = {key: _nan_mean(values) for key, values in details.items()}
    rewards = torch.as_tensor(rewards).float().cpu()
    mean, ci = mean_ci95(rewards)
    return EvalResult(mean, ci, len(all_prompts), rewards, all_prompts, images, attributes, seconds,
                      images_per_prompt, guard_scores)


def _nan_mean(values: torch.Tensor) -> float:
    finite = values[~torch.isnan(values)]
    return float(finite.mean()) if finite.numel() else math.nan
