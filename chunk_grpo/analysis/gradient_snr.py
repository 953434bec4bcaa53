"""Is there anything to learn? The policy-gradient signal-to-noise ratio of a training config.

    python -m chunk_grpo.gradient_snr [--iterations 16] [--first-step 0] [--per-chunk]
                                      [--json FILE] [any flag of python -m chunk_grpo.train]

Runs K independent training iterations with the trainer's own code (prompts, group rollouts,
reward, advantages, chunk losses, backward) at the *same* weights, keeping each iteration's
gradient instead of taking the optimizer step. Each gradient is g_i = g + n_i: the true gradient
plus the noise of one iteration. The mean dot product over pairs i != j estimates |g|^2 without
bias; the mean |g_i|^2 minus it estimates E|n|^2. Their ratio, SNR^2 per iteration, says how many
iterations the optimizer must average before the gradient's direction shows through the noise:
about 1 / SNR^2. Error bars are jackknife standard errors over the K iterations.

`--per-chunk` also measures each chunk's own gradient (every chunk trained each iteration):
which chunks of the trajectory carry signal, and which only add noise.

Gradients are taken before clipping, and no optimizer step is taken; with LoRA they are those
of the adapter weights (at the start, only the zero-initialised B matrices receive any).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from chunk_grpo.algorithm.policy_update import UpdateRecord, accumulate_gradients
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.schema import TrainConfig
from chunk_grpo.runtime import distributed as D
from chunk_grpo.train.loop import collect_batch
from chunk_grpo.train.setup import Trainer, build_trainer


def snr_statistics(grads: torch.Tensor) -> dict[str, float]:
    """Signal, noise and SNR^2 (with jackknife s.e.) of K independent gradients [K, P]."""
    if grads.ndim != 2 or grads.shape[0] < 3:
        raise ValueError(f"need [K, P] gradients with K >= 3 iterations, got "
                         f"{tuple(grads.shape)}")
    gram = grads.double() @ grads.double().T
    k = gram.shape[0]

    def estimate(keep: torch.Tensor) -> tuple[float, float, float]:
        sub = gram[keep][:, keep]
        n = sub.shape[0]
        diag = sub.diagonal().sum()
        signal = float((sub.sum() - diag) / (n * (n - 1)))
        noise = float(diag / n) - signal
        return signal, noise, signal / noise if noise > 0 else math.nan

    signal, noise, snr2 = estimate(torch.ones(k, dtype=torch.bool))
    leave_one_out = []
    for i in range(k):
        keep = torch.ones(k, dtype=torch.bool)
        keep[i] = False
        leave_one_out.append(estimate(keep)[2])
    loo = torch.tensor(leave_one_out, dtype=torch.float64)
    stderr = float(((k - 1) / k * ((loo - loo.mean()) ** 2).sum()).sqrt())
    unit = grads.double() / grads.double().norm(dim=1, keepdim=True).clamp_min(1e-300)
    cos = unit @ unit.T
    mean_cos = float((cos.sum() - cos.diagonal().sum()) / (k * (k - 1)))
    return {"iterations": k, "params": grads.shape[1], "signal": signal, "noise": noise,
            "snr2_per_iteration": snr2, "snr2_stderr": stderr, "mean_pairwise_cosine": mean_cos}


def _flat_gradient(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float()
                      .cpu() for p in params])


def iteration_gradients(tr: Trainer, steps: list[int], progress: bool = True,
                        per_chunk: bool = False
                        ) -> tuple[torch.Tensor | dict[int, torch.Tensor], list[float]]:
    """The gradient [len(steps), P] of each listed iteration at the trainer's current weights,
    and each iteration's mean reward: the trainer's own rollouts, advantages and loss
    gradients (`collect_batch`, `accumulate_gradients`), with no optimizer step, so the weights,
    the optimizer, the schedule and the EMA are untouched.

    ``per_chunk``: every chunk is trained each iteration and the gradients come back per chunk,
    {chunk: [len(steps), P]} (one unit per chunk and micro-batch, each its own accumulation
    boundary; a micro-batch's units are every chunk in order, as `plan_units` lays them out).
    """
    period = tr.layout.num_chunks if per_chunk else 1
    # Every chunk, each unit its own boundary: changes only what is trained, not the rollouts.
    settings = dataclasses.replace(tr.loss_settings, grad_accum=1) if per_chunk \
        else tr.loss_settings
    cfg = tr.cfg.with_changes({"chunks.fraction": 1.0, "run.image_grid_every": 0}) if per_chunk \
        else tr.cfg.with_changes({"run.image_grid_every": 0})
    saved_cfg, tr.cfg = tr.cfg, cfg
    grads: list[list[torch.Tensor]] = [[] for _ in range(period)]
    rewards = []
    chunk_steps = [tr.layout.steps(j) for j in range(tr.layout.num_chunks)]
    try:
        for step in tqdm(steps, desc="gradient-snr", disable=not progress):
            batch = collect_batch(tr, step, split_chunks=per_chunk)
            if per_chunk and batch.metrics.get("chunks_trained") != ",".join(
                    str(j) for j in range(period)):
                raise RuntimeError("per-chunk gradients: the units do not match the chunks")
            sums: list[torch.Tensor | None] = [None] * period
            boundaries = 0
            record = UpdateRecord()
            tr.optimizer.zero_grad(set_to_none=True)
            if batch.finite:
                for nonfinite in accumulate_gradients(
                        tr.policy, batch.rollout, batch.rollout.prompt_embeds, batch.advantages,
                        batch.units, chunk_steps, settings, record, reference=tr.reference):
                    flat = _flat_gradient(tr.params)
                    if nonfinite or not bool(torch.isfinite(flat).all()):
                        break
                    k = boundaries % period
                    sums[k] = flat if sums[k] is None else sums[k] + flat
                    boundaries += 1
                    tr.optimizer.zero_grad(set_to_none=True)
            if boundaries == 0 or any(s is None for s in sums) or boundaries % period:
                raise RuntimeError(f"iteration {step} gave a non-finite reward, loss or gradient; "
                                   "check the reward and the learning setup")
            for j, total in enumerate(sums):
                grads[j].append(total)
            rewards.append(batch.metrics["reward_mean"])
    finally:
        tr.cfg = saved_cfg
        tr.optimizer.zero_grad(set_to_none=True)
    if per_chunk:
        return {j: torch.stack(g) for j, g in enumerate(grads)}, rewards
    return torch.stack(grads[0]), rewards


def measure(cfg: TrainConfig, iterations: int = 16, first_step: int = 0,
            progress: bool = True, per_chunk: bool = False) -> dict:
    """Build the trainer for ``cfg`` (in a scratch directory) and measure its gradient SNR;
    ``per_chunk`` adds {"chunks": {j: statistics of chunk j's gradient, with its "steps"}}."""
    if per_chunk and cfg.sampling.algorithm == "g2rpo":
        raise ConfigError("--per-chunk trains every chunk of each iteration, but G2RPO trains "
                          "one branch step per iteration; measure it without --per-chunk")
    if iterations < 3:
        raise ConfigError(f"--iterations must be >= 3 (pairs of independent gradients), "
                          f"got {iterations}")
    info = D.init_for_config(cfg)
    if info.world_size > 1:
        raise ConfigError("gradient_snr runs in one process; start it without torchrun")
    with tempfile.TemporaryDirectory() as scratch:
        # no frozen base copy needed; the scratch run logs nowhere but its own directory
        cfg = cfg.with_changes({"eval.hybrid_steps": 0, "run.report_to": ["jsonl"]})
        tr = build_trainer(cfg, Path(scratch), info)
        start = time.perf_counter()
        grads, rewards = iteration_gradients(
            tr, list(range(first_step, first_step + iterations)), progress=progress,
            per_chunk=per_chunk)
        seconds = (time.perf_counter() - start) / iterations
        tr.logger.close()
        layout = tr.layout
    if per_chunk:
        stats = snr_statistics(sum(grads.values()))
        stats["chunks"] = {j: dict(snr_statistics(g), steps=layout.steps(j))
                           for j, g in grads.items()}
    else:
        stats = snr_statistics(grads)
    stats.update(images_per_iteration=cfg.sampling.prompts_per_step * cfg.sampling.group_size,
                 reward_mean=sum(rewards) / len(rewards), seconds_per_iteration=seconds)
    return stats


def _verdict(snr2: float, err: float) -> str:
    if snr2 > 2 * err and snr2 > 0:
        return f"the direction shows through the noise after about {math.ceil(1 / snr2)} iterations"
    bound = max(snr2, 0.0) + 2 * err
    many = math.floor(1 / bound) if bound > 0 else "many"
    return (f"no signal detected: SNR^2 below {bound:.4f}, so the optimizer needs more than "
            f"{many} iterations to see the direction")


def summary(stats: dict) -> str:
    snr2, err = stats["snr2_per_iteration"], stats["snr2_stderr"]
    lines = [
        f"gradient SNR over {stats['iterations']} iterations of "
        f"{stats['images_per_iteration']} images ({stats['params']} trainable values)",
        f"  signal |E g|^2 = {stats['signal']:.3e}; noise E|n|^2 per iteration = "
        f"{stats['noise']:.3e}",
        f"  SNR^2 per iteration = {snr2:.4f} +- {err:.4f} (jackknife s.e.); mean pairwise "
        f"cosine {stats['mean_pairwise_cosine']:.4f}",
        f"  {_verdict(snr2, err)}",
    ]
    for j, chunk in stats.get("chunks", {}).items():
        lines.append(f"  chunk {j} (steps {chunk['steps']}): SNR^2 "
                     f"{chunk['snr2_per_iteration']:.4f} +- {chunk['snr2_stderr']:.4f}; "
                     f"{_verdict(chunk['snr2_per_iteration'], chunk['snr2_stderr'])}")
    lines.append(f"  mean reward {stats['reward_mean']:.3f}; "
                 f"{stats['seconds_per_iteration']:.2f} s per iteration")
    return "\n".join(lines)
