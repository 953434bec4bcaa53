"""How a trajectory behaves step by step, measured on a model: where to cut chunks and where
the reward is decided.

`measure_dynamics` gives L1rel(t) = mean|x_{t+1} - x_t| / (mean|x_t| + 1e-8) per transition
(the temporal-dynamics profile the trainer segments into chunks with `propose_chunks`);
`reward_spread_by_step` gives the within-group reward spread one stochastic step at step k
causes (how to choose `sde_window`). The CLIs `python -m chunk_grpo.profile` and
`python -m chunk_grpo.credit` print and save them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from chunk_grpo.algorithm.chunking import (
    ChunkLayout,
    per_trajectory_change,
    relative_change,
    segment_by_dynamics,
)
from chunk_grpo.algorithm.rollout import denoise
from chunk_grpo.algorithm.sigmas import flux_sigmas
from chunk_grpo.config.sampling_options import resolve_cfg_scale


@torch.no_grad()
def measure_dynamics(policy, prompts: list[str], *, num_steps: int, shift: float,
                     sampler: str = "ode", eta: float = 0.0, cfg_scale: float | None = None,
                     seed: int = 0, batch_size: int = 64,
                     mixed_precision: str = "no") -> torch.Tensor:
    """L1rel(t) for the T transitions, averaged over one trajectory per prompt. [T] float32.
    ``mixed_precision``: the autocast of the transformer calls (the run's)."""
    cfg = resolve_cfg_scale(policy, cfg_scale)
    sigmas = flux_sigmas(num_steps, shift)
    generator = torch.Generator().manual_seed(seed)
    curves, weights = [], []
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start:start + batch_size])
        embeds = policy.encode_prompts(batch)
        x = policy.initial_noise(len(batch), generator).float()
        latents = denoise(policy, x, embeds, sigmas, sampler=sampler, eta=eta, cfg_scale=cfg,
                          generator=generator, mixed_precision=mixed_precision,
                          keep=True).latents
        curves.append(relative_change(latents) * len(batch))
        weights.append(len(batch))
    return torch.stack(curves).sum(0) / sum(weights)


@torch.no_grad()
def dynamics_sum(policy, prompts: list[str], *, num_steps: int, shift: float,
                 cfg_scale: float | None = None, seed: int = 0, batch_size: int = 64,
                 mixed_precision: str = "no", share: tuple[int, int] = (0, 1)
                 ) -> tuple[torch.Tensor, int]:
    """This process's part of `measure_dynamics` (ODE sampler) when ``share`` = (index,
    count) processes split the prompts: (sum over its trajectories of each one's L1rel(t)
    [T] float64, its number of trajectories). Summed over the processes and divided, it is the
    single-process curve up to float reduction order.

    Process i takes a contiguous slice of the prompts. Every trajectory starts from the noise
    one process draws for it (the whole draw is repeated here, it is small), and every process
    makes the same number of transformer calls (one that runs out of prompts repeats a
    1-prompt trajectory and drops it), as FSDP's collectives in each call need."""
    index, count = share
    cfg = resolve_cfg_scale(policy, cfg_scale)
    sigmas = flux_sigmas(num_steps, shift)
    generator = torch.Generator().manual_seed(seed)
    noise = torch.cat([policy.initial_noise(len(prompts[s:s + batch_size]), generator).float()
                       for s in range(0, len(prompts), batch_size)])
    bounds = [len(prompts) * i // count for i in range(count + 1)]
    mine = range(bounds[index], bounds[index + 1])
    calls = math.ceil(max(bounds[i + 1] - bounds[i] for i in range(count)) / batch_size)
    total = torch.zeros(num_steps, dtype=torch.float64)
    for call in range(calls):
        rows = list(mine[call * batch_size:(call + 1) * batch_size])
        kept = bool(rows)
        rows = rows or [0]  # the same calls as the other processes, result dropped
        embeds = policy.encode_prompts([prompts[r] for r in rows])
        latents = denoise(policy, noise[rows], embeds, sigmas, sampler="ode", eta=0.0,
                          cfg_scale=cfg, mixed_precision=mixed_precision, keep=True).latents
        if kept:
            total += per_trajectory_change(latents).double().sum(0).cpu()
    return total, len(mine)


def shared_dynamics(policy, prompts: list[str], *, info, sharded: bool, **settings
                    ) -> torch.Tensor:
    """`measure_dynamics` measured once for a job of ``info.world_size`` ranks, the same curve
    on every rank. ``sharded`` (FSDP: every rank must join every transformer call): the ranks
    split the prompts (`dynamics_sum`) and sum their parts with one all-reduce; otherwise
    rank 0 measures alone and broadcasts the curve. ``settings``: `measure_dynamics`'s."""
    if info.world_size == 1:
        return measure_dynamics(policy, prompts, **settings)
    if sharded:
        total, n = dynamics_sum(policy, prompts, share=(info.rank, info.world_size), **settings)
        both = torch.cat([total, torch.tensor([float(n)], dtype=torch.float64)]).to(info.device)
        dist.all_reduce(both)
        return (both[:-1] / both[-1]).float().cpu()
    curve = torch.zeros(settings["num_steps"], dtype=torch.float32)
    if info.is_main:
        curve = measure_dynamics(policy, prompts, **settings)
    curve = curve.to(info.device)
    dist.broadcast(curve, src=0)
    return curve.cpu()


def propose_chunks(curve: torch.Tensor, max_size: int = 5,
                   num_trained: int | None = None) -> ChunkLayout:
    """Chunks of the trained transitions: the first ``num_trained`` (default T-1: the last
    transition is never trained)."""
    w = curve.numel() - 1 if num_trained is None else num_trained
    return segment_by_dynamics(curve[:w], max_size=max_size)


@torch.no_grad()
def reward_spread_by_step(policy, prompts: list[str], reward, *, num_steps: int, shift: float,
                          kind: str = "flow", eta: float = 0.7, group_size: int = 8,
                          cfg_scale: float | None = None, seed: int = 0,
                          mixed_precision: str = "no") -> dict[str, list[float]]:
    """Per trained step k (0 .. T-2): mean within-group reward std and mean reward when only
    step k is stochastic. Returns {"sigma": [...], "spread": [...], "reward": [...]}."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 to measure a spread, got {group_size}")
    cfg = resolve_cfg_scale(policy, cfg_scale)
    sigmas = flux_sigmas(num_steps, shift)
    generator = torch.Generator().manual_seed(seed)
    rows = torch.arange(len(prompts)).repeat_interleave(group_size)
    embeds = policy.encode_prompts(list(prompts))
    row_prompts = [prompts[i] for i in rows.tolist()]
    start = policy.initial_noise(len(prompts), generator).float()
    # The ODE steps before the branch are the same for every k: run the trajectory once.
    ode_path = denoise(policy, start, embeds, sigmas, sampler="ode", eta=0.0, cfg_scale=cfg,
                       mixed_precision=mixed_precision, keep=True).latents
    ode_path = ode_path.repeat_interleave(group_size, 0)
    group_embeds = embeds.index(rows)
    out = {"sigma": [], "spread": [], "reward": []}
    for k in range(num_steps - 1):
        # From x_k: one SDE step (a window of 1 on the schedule's tail), then the ODE.
        x = denoise(policy, ode_path[:, k], group_embeds, sigmas[k:], sampler=kind, eta=eta,
                    cfg_scale=cfg, generator=generator, mixed_precision=mixed_precision,
                    sde_window=1, sigma_max=float(sigmas[1])).x
        scores = reward(policy.decode(x).float(), row_prompts).float().view(-1, group_size)
        out["sigma"].append(float(sigmas[k]))
        out["spread"].append(float(scores.std(dim=1).mean()))
        out["reward"].append(float(scores.mean()))
    return out
