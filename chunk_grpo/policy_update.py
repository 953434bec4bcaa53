"""Train chunk by chunk: recompute a chunk's log-probs in one call, the chunk loss, backward.

A training unit is (chunk, micro-batch of rows). Its log-probs come from one batched transformer
call over chunk size x micro-batch rows at their own sigmas. The old log-probs are exact: a unit
trained before the first optimizer step of an iteration uses its own detached recomputation (the
policy has not moved since the rollout), and every other unit gets a no-grad recomputation with
the same call taken before any update. So the ratio is exactly 1 on-policy whatever the batch
layout of the rollout was (the sampler's own log-probs differ from the training call's in the last
bits whenever the two batch layouts differ; they are kept as a diagnostic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import grpo_kernels
from chunk_grpo.rollout import Rollout, autocast_context


@dataclass(frozen=True)
class TrainUnit:
    chunk: int
    rows: torch.Tensor  # [m] long, sorted


def plan_units(selected_chunks: list[int], num_rows: int, micro_batch_size: int,
               generator: torch.Generator | None = None) -> list[TrainUnit]:
    """Rows shuffled into micro-batches; each micro-batch trains every selected chunk."""
    perm = torch.randperm(num_rows, generator=generator)
    units = []
    for rows in perm.split(micro_batch_size):
        rows = rows.sort().values
        units.extend(TrainUnit(j, rows) for j in selected_chunks)
    return units


def optimizer_step_after(num_units: int, grad_accum: int) -> list[bool]:
    """Whether an optimizer step follows each unit (every grad_accum units; 0 = at the end)."""
    every = num_units if grad_accum == 0 else grad_accum
    return [(k + 1) % every == 0 or k == num_units - 1 for k in range(num_units)]


def chunk_logprobs(policy, rollout: Rollout, prompt_embeds, rows: torch.Tensor,
                   steps: list[int], *, kind: str, eta: float, cfg_scale: float,
                   mixed_precision: str = "no") -> torch.Tensor:
    """Log-probs [m, c] of the stored transitions x_t -> x_{t+1}, t in ``steps``, for ``rows``.

    One transformer call with m * c rows (sample-major), each at its own sigma.
    """
    m, c = rows.numel(), len(steps)
    device = rollout.latents.device
    t = torch.tensor(steps, dtype=torch.long)
    x = rollout.latents[rows][:, t].flatten(0, 1)
    x_next = rollout.latents[rows][:, t + 1].flatten(0, 1)
    sigma = rollout.sigmas[t].repeat(m).to(device)
    sigma_next = rollout.sigmas[t + 1].repeat(m).to(device)
    embeds = prompt_embeds.index(rollout.prompt_index[rows].repeat_interleave(c))
    with autocast_context(x.device, mixed_precision):
        v = policy.velocity(x, sigma, embeds, cfg_scale=cfg_scale)
    logp = grpo_kernels.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=eta, kind=kind,
                                         sigma_max=float(rollout.sigmas[1]))
    return logp.view(m, c)


def unit_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, *,
              clip_low: float, clip_high: float, kl_coef: float = 0.0,
              logp_ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The chunk-level clipped loss of one unit (one chunk), plus an optional reference KL.

    KL: with ``logp_ref`` None, ``kl_coef`` weighs k3 against the old policy (in the fused
    loss); otherwise k3 against the reference log-probs is added here.
    """
    c = logp_new.shape[1]
    loss, stats = grpo_kernels.chunk_grpo_loss(
        logp_new, logp_old, advantages, [c], clip_low=clip_low, clip_high=clip_high,
        kl_coef=kl_coef if logp_ref is None else 0.0)
    if logp_ref is not None and kl_coef > 0:
        diff = logp_ref.detach() - logp_new
        k3 = (torch.exp(diff) - diff - 1.0).mean()
        loss = loss + kl_coef * k3
        stats = dict(stats, ref_kl=k3.detach())
    return loss, stats


@dataclass
class UpdateResult:
    """What one iteration's update did, for logging."""

    optimizer_steps: int = 0
    skipped_steps: int = 0  # optimizer steps dropped for a non-finite loss or gradient
    losses: list[float] = None
    grad_norms: list[float] = None
    chunk_stats: dict[int, dict[str, list[float]]] = None  # chunk -> stat -> values
    rollout_logp_gap: float = 0.0  # max |sampler logp - training recomputation| (diagnostic)

    def __post_init__(self):
        self.losses, self.grad_norms, self.chunk_stats = [], [], {}


def _is_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def update_policy(policy, params: list, optimizer, scheduler, rollout: Rollout, prompt_embeds,
                  advantages: torch.Tensor, units: list[TrainUnit], chunk_steps: list[list[int]],
                  cfg, *, cfg_scale: float, ema=None, reduce_grads=None) -> UpdateResult:
    """Train the units (ppo_epochs passes), stepping the optimizer every cfg.grad_accum units.

    chunk_steps[j] lists chunk j's transitions. ``reduce_grads(params, bad) -> bad`` averages
    gradients and the skip flag across ranks before clipping (None on one process).
    """
    result = UpdateResult()
    step_after = optimizer_step_after(len(units), cfg.grad_accum)
    group_sizes, count = [], 0  # units per optimizer step, for the loss scale
    for last in step_after:
        count += 1
        if last:
            group_sizes.extend([count] * count)
            count = 0
    first_boundary = step_after.index(True)

    def logprobs(unit: TrainUnit) -> torch.Tensor:
        return chunk_logprobs(policy, rollout, prompt_embeds, unit.rows, chunk_steps[unit.chunk],
                              kind=cfg.sde_kind, eta=cfg.eta, cfg_scale=cfg_scale,
                              mixed_precision=cfg.mixed_precision)

    # Old log-probs of units trained after the policy first moves, taken before it moves.
    snapshot: dict[int, torch.Tensor] = {}
    reference: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for k, unit in enumerate(units):
            if cfg.ppo_epochs > 1 or k > first_boundary:
                snapshot[k] = logprobs(unit)
        if cfg.kl_coef > 0 and cfg.kl_ref == "reference":
            policy.transformer.disable_adapters()
            try:
                reference = {k: logprobs(unit) for k, unit in enumerate(units)}
            finally:
                policy.transformer.enable_adapters()

    bad = False
    optimizer.zero_grad(set_to_none=True)
    for _epoch in range(cfg.ppo_epochs):
        for k, unit in enumerate(units):
            logp_new = logprobs(unit)
            if k in snapshot:
                logp_old = snapshot[k]
            else:
                logp_old = logp_new.detach()
                gap = (logp_old - rollout.logps[unit.rows][:, chunk_steps[unit.chunk]]).abs()
                result.rollout_logp_gap = max(result.rollout_logp_gap, float(gap.max()))
            loss, stats = unit_loss(logp_new, logp_old, advantages[unit.rows],
                                    clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                    kl_coef=cfg.kl_coef, logp_ref=reference.get(k))
            if _is_finite(loss):
                (loss / group_sizes[k]).backward()
                result.losses.append(float(loss.detach()))
                per_chunk = result.chunk_stats.setdefault(unit.chunk, {})
                for name in ("ratio_mean", "clip_frac", "approx_kl", "ref_kl"):
                    if name in stats:
                        per_chunk.setdefault(name, []).append(float(stats[name].detach()))
            else:
                bad = True
            if step_after[k]:
                if reduce_grads is not None:
                    bad = reduce_grads(params, bad)
                norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                if bad or not _is_finite(norm):
                    result.skipped_steps += 1
                else:
                    optimizer.step()
                    scheduler.step()
                    if ema is not None:
                        ema.update()
                    result.optimizer_steps += 1
                    result.grad_norms.append(float(norm))
                optimizer.zero_grad(set_to_none=True)
                bad = False
    return result
