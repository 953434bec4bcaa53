"""A run's checkpoints, in the format its world size calls for.

One process writes one file (`chunk_grpo.train.checkpoint`: the trained weights, the optimizer,
schedule and EMA, atomically, with a manifest). Several ranks write sharded checkpoints
(`chunk_grpo.train.sharded_checkpoint`, torch.distributed.checkpoint): every rank its own shards,
with no gather on rank 0. A sharded checkpoint loads at any world size (DCP reshards); the per-rank
batch then changes so that the global batch stays (`resume_batch_plan`), which the run prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import config_from_saved
from chunk_grpo.config.schema import PATHS, TrainConfig
from chunk_grpo.runtime.parallelize import all_finite, is_sharded
from chunk_grpo.train.checkpoint import (
    STATE,
    CheckpointError,
    nonfinite_tensors,
    print_note,
    safe_load,
    save_checkpoint,
    set_rng_state,
)
from chunk_grpo.train.setup import Trainer, checkpoint_state, restore_chunk_counts, restore_state
from chunk_grpo.train.sharded_checkpoint import (
    TRAINER,
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    resume_batch_plan,
    save_sharded_checkpoint,
    select_checkpoint,
)


class NonFiniteWeights(RuntimeError):
    """The trained weights hold NaN/Inf; the message names one (they are not saved)."""


def _run_state(tr: Trainer, bad_streak: int) -> dict:
    """What a sharded checkpoint keeps besides the shards (rank 0's small state)."""
    return {"scheduler": tr.scheduler.state_dict(), "bad_streak": bad_streak,
            "chunk_layout": list(tr.layout.sizes), "chunk_weights": tr.chunk_weights,
            "config": tr.cfg.to_dict(), "ema_decay": tr.ema.decay if tr.ema else None,
            "counts": dict(tr.counts), "chunk_counts": list(tr.chunk_counts)}


def _ema_tensors(tr: Trainer) -> dict[str, torch.Tensor] | None:
    return None if tr.ema is None else {f"ema.{k}": v for k, v in tr.ema.shadow.items()}


def save_run_checkpoint(tr: Trainer, step: int, bad_streak: int) -> None:
    """Checkpoint ``step`` (every rank calls this). NaN/Inf weights are never saved: the last
    checkpoint on disk stays the one to resume (NonFiniteWeights)."""
    cfg = tr.cfg
    if tr.info.world_size == 1 and not is_sharded(tr.module):
        state = checkpoint_state(tr, bad_streak)
        bad = nonfinite_tensors(state["model"])
        if bad:
            raise NonFiniteWeights(f"{len(bad)} trained tensor(s) (e.g. {bad[0]})")
        state["world_size"] = 1
        save_checkpoint(tr.run_dir, step, state, keep=cfg.run.keep_checkpoints)
        return
    if not all_finite(tr.params, tr.info.device):
        raise NonFiniteWeights("some trained tensor(s)")
    save_sharded_checkpoint(tr.run_dir, step, tr.module, tr.optimizer, _run_state(tr, bad_streak),
                            extra=_ema_tensors(tr), keep=cfg.run.keep_checkpoints)


@dataclass
class Resume:
    """A run's newest intact checkpoint, read before its trainer is built."""

    path: Path
    step: int
    bad_streak: int
    layout: tuple[int, ...]
    chunk_weights: torch.Tensor | None
    state: dict  # the whole single-file state, or a sharded checkpoint's trainer.pt

    @property
    def sharded(self) -> bool:
        return is_sharded_checkpoint(self.path)


def find_run_checkpoint(run_dir: Path, *, trust: bool = False) -> Resume:
    """The newest intact checkpoint of ``run_dir`` (either format, verified against its
    manifest before anything is read; ``trust``: one without a manifest too); restores the RNG
    state of a single-file one, as an uninterrupted run would have it. Every rank calls this."""
    path = select_checkpoint(run_dir, trust=trust)
    sharded = is_sharded_checkpoint(path)
    state = safe_load(path / (TRAINER if sharded else STATE))
    if not sharded:
        print_note(set_rng_state(state["rng"]))
    return Resume(path=path, step=state["step"], bad_streak=state["bad_streak"],
                  layout=tuple(state["chunk_layout"]), chunk_weights=state["chunk_weights"],
                  state=state)


# Every config key is in exactly one of the four groups below
# (tests/integration/test_train_resume.py checks it, so a new key must be classified).
# What the checkpoint's tensors, chunk layout (and its profile's weights) and random streams were
# built from: these cannot change on resume.
FIXED_ON_RESUME = ("model.name", "model.lora_rank", "model.lora_alpha", "model.lora_targets",
                   "model.base_quantization", "sampling.algorithm", "sampling.steps",
                   "sampling.sde_window",
                   "chunks.spec", "chunks.size", "chunks.weighted", "chunks.profile_prompts",
                   "chunks.max_size", "optim.name", "run.output_dir", "run.seed",
                   "run.wandb_project")


def check_fixed_keys(cfg: TrainConfig, resume: Resume) -> None:
    """A ConfigError naming every `FIXED_ON_RESUME` key whose value differs from the one the
    checkpoint was saved with (nothing is changed)."""
    saved = config_from_saved(resume.state["config"])
    changed = [f"{path} {saved.get(path)!r} -> {cfg.get(path)!r}" for path in FIXED_ON_RESUME
               if saved.get(path) != cfg.get(path)]
    if changed:
        raise ConfigError(f"{resume.path} was saved with other values of keys that cannot change "
                          f"on resume ({'; '.join(changed)}): resume without changing them, or "
                          "start a new run with another output_dir")


# Set per rank by `config_for_world`, which prints its own line when they change.
PER_RANK_ON_RESUME = ("sampling.prompts_per_step", "optim.grad_accum")
# What the restored optimizer, schedule and EMA hold that the config sets: written into them
# (the schedule's shape and length come from the config the trainer is rebuilt with).
OPTIMIZER_ON_RESUME = ("optim.lr", "optim.weight_decay", "optim.beta1", "optim.beta2",
                       "optim.eps", "optim.warmup_steps", "optim.schedule", "optim.ema_decay",
                       "run.max_steps")
# Read from the config the resumed trainer is built with, at start-up or every iteration (the
# model is loaded, the reward built and the prompts read anew): a new value simply applies.
APPLIED_ON_RESUME = (
    "model.height", "model.width", "model.mixed_precision", "model.weights_dtype",
    "model.attention_backend", "model.gradient_checkpointing", "model.compile_blocks",
    "model.guidance", "model.text_encoders", "model.prompt_cache_dir", "model.tf32",
    "reward.name", "reward.mix_advantage", "reward.device", "reward.batch_size",
    "reward.overlap", "reward.timeout", "data.train_prompts", "data.eval_prompts",
    "sampling.g2rpo_granularities", "sampling.shift", "sampling.dynamic_shift", "sampling.sde",
    "sampling.eta", "sampling.cfg_scale", "sampling.group_size", "sampling.shared_noise",
    "sampling.antithetic_noise", "sampling.decode", "sampling.batch_size", "chunks.fraction",
    "loss.adv_norm", "loss.adv_clip_max", "loss.adv_eps", "loss.clip_low", "loss.clip_high",
    "loss.kl_coef", "loss.kl_ref", "optim.max_grad_norm", "optim.micro_batch_size",
    "optim.ppo_epochs", "parallel.mode", "parallel.cpu_offload", "parallel.reduce_dtype",
    "parallel.timeout_minutes", "eval.every", "eval.images", "eval.final_images",
    "eval.hybrid_steps", "eval.guard_reward", "eval.guard_stop", "run.device",
    "run.max_minutes", "run.log_every", "run.image_grid_every", "run.checkpoint_every",
    "run.keep_checkpoints", "run.max_bad_steps", "run.progress", "run.export", "run.report_to",
    "run.name")


def apply_resume_changes(tr: Trainer, resume: Resume) -> str | None:
    """Apply to a restored trainer the settings that changed since its checkpoint (the
    optimizer's lr, betas, eps and weight decay, the schedule's length and shape, the EMA
    decay; everything else is read from the config as the run goes), and return the line that
    lists every changed key (None: nothing changed)."""
    saved, cfg = config_from_saved(resume.state["config"]), tr.cfg
    changed = [path for path in PATHS if path in (*OPTIMIZER_ON_RESUME, *APPLIED_ON_RESUME)
               and saved.get(path) != cfg.get(path)]
    if not changed:
        return None
    if any(path in OPTIMIZER_ON_RESUME for path in changed):
        optim, scheduler = cfg.optim, tr.scheduler
        scheduler.base_lrs = [optim.lr] * len(tr.optimizer.param_groups)
        lrs = [optim.lr * factor(scheduler.last_epoch) for factor in scheduler.lr_lambdas]
        for group, lr in zip(tr.optimizer.param_groups, lrs, strict=True):
            group.update(lr=lr, initial_lr=optim.lr, weight_decay=optim.weight_decay,
                         betas=(optim.beta1, optim.beta2), eps=optim.eps)
        scheduler._last_lr = lrs  # what get_last_lr() reports until the next step
        if tr.ema is not None:
            tr.ema.decay = optim.ema_decay
    return ("[chunk-grpo] resuming with changed settings: "
            + ", ".join(f"{path} {saved.get(path)!r} -> {cfg.get(path)!r}" for path in changed))


def config_for_world(cfg: TrainConfig, resume: Resume, world_size: int) -> tuple[TrainConfig,
                                                                                 str | None]:
    """The config to resume with at ``world_size``: the per-rank prompts and grad_accum that
    keep the checkpoint's global batch (or the prompts_per_step given on resume), and the line
    that says what changed (None: nothing). A batch that cannot be split is a WorldSizeError."""
    saved_cfg = config_from_saved(resume.state["config"])
    saved_world = resume.state.get("world_size", 1)
    saved_prompts = saved_cfg.sampling.prompts_per_step
    asked = cfg.sampling.prompts_per_step
    plan = resume_batch_plan(saved_world_size=saved_world, saved_prompts_per_step=saved_prompts,
                             saved_grad_accum=saved_cfg.optim.grad_accum, world_size=world_size,
                             requested_prompts_per_step=None if asked == saved_prompts
                             else asked)
    changed = cfg.with_changes({"sampling.prompts_per_step": plan.prompts_per_step,
                                "optim.grad_accum": plan.grad_accum}).validate()
    return changed, plan.message


def restore_run(tr: Trainer, resume: Resume) -> None:
    """Load ``resume`` into a freshly built trainer (every rank calls this)."""
    if resume.sharded:
        load_sharded_checkpoint(resume.path, tr.module, tr.optimizer, extra=_ema_tensors(tr),
                                restore_rng=True, verified=True)
        tr.scheduler.load_state_dict(resume.state["scheduler"])
        tr.counts.update(resume.state.get("counts", {}))
        restore_chunk_counts(tr, resume.state)
        return
    if is_sharded(tr.module):
        raise CheckpointError(f"{resume.path} was written by one process; resume it on one "
                              f"process or with parallelism: ddp (a sharded checkpoint, written "
                              f"by a multi-rank run, resumes at any world size)")
    restore_state(tr, resume.state)
