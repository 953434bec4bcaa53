"""Group-relative advantages: each image's reward against the other images of its prompt."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, *, norm: str = "group",
                     eps: float = 1e-4, clip_max: float | None = None,
                     all_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """A = (r - mean_group) / (std + eps), clipped to [-clip_max, clip_max].

    rewards: [P * G] float, grouped consecutively (G images of prompt 0, then prompt 1, ...).
    norm: "group" divides by the group's std, "global" by the std of ``all_rewards`` (every
    reward gathered across ranks; defaults to ``rewards``), "none" only subtracts the mean.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} "
                         f"entries, got shape {tuple(rewards.shape)}")
    r = rewards.float().view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if norm == "group":
        adv = centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    elif norm == "global":
        pool = rewards if all_rewards is None else all_rewards
        adv = centred / (pool.float().std(unbiased=False) + eps)
    elif norm == "none":
        adv = centred
    else:
        raise ValueError(f"norm must be 'group', 'global' or 'none', got {norm!r}")
    adv = adv.reshape(-1)
    if clip_max is not None:
        adv = adv.clamp(-clip_max, clip_max)
    return adv


def multi_granularity_advantages(rewards: list[torch.Tensor], group_size: int, *,
                                 norm: str = "group", eps: float = 1e-4,
                                 clip_max: float | None = None,
                                 all_rewards: list[torch.Tensor] | None = None) -> torch.Tensor:
    """G2RPO's integration: the sum over finishes of each finish's group advantages, clipped.

    rewards[g]: [P * G] rewards of the same images finished at granularity g (see
    `chunk_grpo.algorithm.branching`). Each finish is normalised on its own (unclipped), then the
    sum is clipped to [-clip_max, clip_max]. One finish is exactly `group_advantages`.
    """
    if not rewards:
        raise ValueError("rewards must hold at least one finish")
    pools = all_rewards if all_rewards is not None else [None] * len(rewards)
    if len(pools) != len(rewards):
        raise ValueError(f"all_rewards has {len(pools)} finishes, rewards {len(rewards)}")
    total = sum(group_advantages(r, group_size, norm=norm, eps=eps, all_rewards=pool)
                for r, pool in zip(rewards, pools, strict=True))
    if clip_max is not None:
        total = total.clamp(-clip_max, clip_max)
    return total


def per_reward_advantages(rewards: list[tuple[float, torch.Tensor, torch.Tensor | None]],
                          group_size: int, *, norm: str = "group", eps: float = 1e-4,
                          clip_max: float | None = None) -> torch.Tensor:
    """Advantages of a reward mix, each reward normalised on its own (Flow-GRPO's multi-reward):
    sum_k w_k * A_k, with A_k the unclipped `group_advantages` of reward k, then clipped to
    [-clip_max, clip_max].

    rewards: (w_k, rewards_k [P * G], all_rewards_k gathered across ranks or None) per reward
    (and, under G2RPO, per finish). A reward on a larger scale then weighs no more than
    another: the weights alone set the mix.
    """
    if not rewards:
        raise ValueError("rewards must hold at least one (weight, rewards, all_rewards) entry")
    total = sum(weight * group_advantages(r, group_size, norm=norm, eps=eps, all_rewards=pool)
                for weight, r, pool in rewards)
    if clip_max is not None:
        total = total.clamp(-clip_max, clip_max)
    return total
