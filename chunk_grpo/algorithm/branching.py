"""G2RPO's rollouts: singular stochastic sampling, finished at several granularities.

Per prompt one deterministic ODE trajectory runs from its initial noise to step k. There the
group branches: G stochastic steps x_k -> x_{k+1} (the only sampled transition, the only one
trained), then each branch is finished by the ODE to sigma = 0 at several granularities: stride
g takes every g-th sigma of the rest of the schedule (always ending at 0). Every difference
inside a group comes from the one perturbation at step k, so the advantage is credited to it;
the finishes, scored separately, are what `advantages.multi_granularity_advantages` integrates.
"""

from __future__ import annotations

import torch

from chunk_grpo.algorithm.noise import initial_noise, step_noise
from chunk_grpo.algorithm.rollout import (
    Rollout,
    RolloutSettings,
    decode_images,
    denoise,
    prepare_rollout,
)


def tail_sigmas(sigmas: torch.Tensor, start: int, stride: int) -> torch.Tensor:
    """sigmas[start], every ``stride``-th one after it, and always the final 0."""
    tail = sigmas[start::stride]
    if float(tail[-1]) != float(sigmas[-1]):
        tail = torch.cat([tail, sigmas[-1:]])
    return tail


@torch.no_grad()
def sample_branch_rollouts(policy, prompts: list[str], settings: RolloutSettings, *,
                           branch_step: int, granularities: tuple[int, ...], step: int = 0,
                           row_offset: int = 0) -> tuple[Rollout, list[torch.Tensor]]:
    """G branches per prompt at step ``branch_step``; returns (rollout, images per granularity).

    The rollout holds, for every row, the shared ODE prefix x_0..x_k and its own x_{k+1}
    (latents [B, T+1], NaN after k+1: the finishes are not trained); ``logps`` [B, k+1] has the
    branch step's log-prob in column k and NaN before it (no other transition was sampled);
    ``images`` are the first granularity's.
    ``settings.antithetic_noise`` gives rows 2i and 2i+1 of a group opposite branch noise;
    ``settings.shared_noise`` and ``settings.sde_window`` do not apply.
    Noise is keyed as in `sample_rollouts`: a prompt's initial noise by its global index
    (``row_offset`` // G + p), a row's branch noise by its global row ``row_offset`` + r.
    """
    num_steps, group_size, batch_size = settings.num_steps, settings.group_size, \
        settings.batch_size
    kind, eta, seed, decode = settings.kind, settings.eta, settings.seed, settings.decode
    mixed_precision, validate = settings.mixed_precision, settings.validate
    if not 0 <= branch_step < num_steps - 1:
        raise ValueError(f"branch_step must be in [0, {num_steps - 2}] (the last transition is "
                         f"not trained), got {branch_step}")
    setup = prepare_rollout(policy, prompts, settings, row_offset)
    sigmas, cfg, prompt_embeds = setup.sigmas, setup.cfg_scale, setup.prompt_embeds
    rows, prompt_index = setup.rows, setup.prompt_index
    k = branch_step
    sigma_max = float(sigmas[1])  # the flow kind's s_1 comes from the full schedule
    # All draws up front (initial noise per prompt, the branch noise per row), keyed by global
    # index, so results depend on neither batch_size nor the rank.
    noise = initial_noise(policy, setup.global_prompts, seed=seed, step=step).float()
    branch_noise = step_noise(setup.global_rows, tuple(noise.shape[1:]), 1, seed=seed, step=step,
                              purpose="branch")
    if settings.antithetic_noise:
        branch_noise[:, 1::2] = -branch_noise[:, 0::2]

    # The shared prefix: one ODE trajectory per prompt, x_0 .. x_k.
    prefix = []
    for start in range(0, len(prompts), batch_size):
        idx = torch.arange(start, min(start + batch_size, len(prompts)))
        embeds = prompt_embeds.index(idx)
        prefix.append(denoise(policy, noise[idx], embeds, sigmas[:k + 1], sampler="ode",
                              eta=0.0, cfg_scale=cfg, mixed_precision=mixed_precision,
                              keep=True, sigma_max=sigma_max, validate=validate).latents)
    prefix = torch.cat(prefix).repeat_interleave(group_size, 0)  # [B, k+1, N, C]

    all_latents, logps = [], []
    finishes: list[list[torch.Tensor]] = [[] for _ in granularities]
    # The branch step and the first finish in one call: an SDE window of 1 on the tail.
    first_tail = torch.cat([sigmas[k:k + 1], tail_sigmas(sigmas, k + 1, granularities[0])])
    for start in range(0, rows, batch_size):
        sl = slice(start, start + batch_size)
        embeds = prompt_embeds.index(prompt_index[sl])
        branch = denoise(policy, prefix[sl, k], embeds, first_tail, sampler=kind, eta=eta,
                         cfg_scale=cfg, mixed_precision=mixed_precision, keep=True,
                         sde_window=1, step_noise=branch_noise[:, sl], sigma_max=sigma_max,
                         validate=validate)
        x_next, logp = branch.latents[:, 1], branch.logps
        finishes[0].append(decode_images(policy, branch, decode))
        for stride, out in zip(granularities[1:], finishes[1:], strict=True):
            tail = tail_sigmas(sigmas, k + 1, stride)
            finish = denoise(policy, x_next, embeds, tail, sampler="ode", eta=0.0,
                             cfg_scale=cfg, mixed_precision=mixed_precision, sigma_max=sigma_max,
                             validate=validate)
            out.append(decode_images(policy, finish, decode))
        b = x_next.shape[0]
        unused = x_next.new_full((b, num_steps - k - 1, *x_next.shape[1:]), float("nan"))
        all_latents.append(torch.cat([prefix[sl], x_next[:, None], unused], dim=1))
        column = logp.new_full((b, k + 1), float("nan"))
        column[:, k] = logp[:, 0]
        logps.append(column)
    images = [torch.cat(out) for out in finishes]
    rollout = Rollout(latents=torch.cat(all_latents), logps=torch.cat(logps), sigmas=sigmas,
                      prompt_index=prompt_index, prompts=list(prompts), images=images[0],
                      prompt_embeds=prompt_embeds)
    return rollout, images
