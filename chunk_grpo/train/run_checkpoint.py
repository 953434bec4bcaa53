"""A run's checkpoints: the trainer's state as `Stateful` objects, assembled in one place.

`trainer_state` names what a checkpoint holds: the trained weights ("model"), the optimizer
("optimizer"), the EMA's averages ("ema", when the run keeps one) and the run's plain state
("run": step, bad streak, schedule, chunk layout, weights and counts, config, world size and
every rank's random generators). `chunk_grpo.train.checkpoint` writes it with
torch.distributed.checkpoint, the same on one process and on any number of DDP / FSDP ranks, and
a checkpoint loads at any world size (DCP reshards); the per-rank batch then changes so that the
global batch stays (`resume_batch_plan`), which the run prints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import config_from_saved
from chunk_grpo.config.schema import PATHS, TrainConfig
from chunk_grpo.runtime.parallelize import all_finite, unwrapped
from chunk_grpo.train.checkpoint import (
    CheckpointError,
    ModelState,
    OptimizerState,
    print_note,
    rank,
    read_checkpoint,
    restore_checkpoint,
    rng_state,
    save_checkpoint,
    saved_names,
    select_checkpoint,
    set_rng_state,
)
from chunk_grpo.train.setup import Trainer


class NonFiniteWeights(RuntimeError):
    """The trained weights hold NaN/Inf; the message names one (they are not saved)."""


class WorldSizeError(ValueError):
    """A checkpoint's global batch cannot be kept at this world size; the message says how."""


class RunState(Stateful):
    """The trainer's plain state: what the run needs besides its tensors to go on exactly."""

    # Nested plain values saved as one JSON string each: DCP would save each of their leaves
    # apart and drop empty dicts (the schedule's lr_lambdas), which the loaders expect.
    JSON = ("scheduler", "config", "counts")

    def __init__(self, tr: Trainer, step: int = 0, bad_streak: int = 0):
        self.tr, self.step, self.bad_streak = tr, step, bad_streak

    def state_dict(self) -> dict:
        tr = self.tr
        return {"step": self.step, "bad_streak": self.bad_streak,
                "world_size": tr.info.world_size,
                "scheduler": json.dumps(tr.scheduler.state_dict()),
                "chunk_layout": list(tr.layout.sizes), "chunk_weights": tr.chunk_weights,
                "config": json.dumps(tr.cfg.to_dict()), "counts": json.dumps(dict(tr.counts)),
                "chunk_counts": list(tr.chunk_counts),
                "rng": {f"rank{rank()}": rng_state()}}  # per rank: each its own name

    def load_state_dict(self, state: dict) -> None:
        """Restore the schedule, counts and this rank's generators (a rank the checkpoint had
        no counterpart of takes rank 0's)."""
        tr = self.tr
        tr.scheduler.load_state_dict(state["scheduler"])
        tr.counts.update(state.get("counts", {}))
        saved = state.get("chunk_counts")
        if saved is not None and len(saved) == tr.layout.num_chunks:
            tr.chunk_counts = [int(n) for n in saved]
        rngs = state["rng"]
        print_note(set_rng_state(rngs.get(f"rank{rank()}", rngs["rank0"])))


def trainer_state(tr: Trainer, step: int = 0, bad_streak: int = 0, *,
                  ema: bool = True) -> dict[str, Stateful]:
    """Everything a checkpoint of ``tr`` holds, by name (``ema``: with the EMA, if any)."""
    state = {"model": ModelState(tr.module), "optimizer": OptimizerState(tr.module, tr.optimizer),
             "run": RunState(tr, step, bad_streak)}
    if ema and tr.ema is not None:
        state["ema"] = tr.ema
    return state


def _nonfinite(tr: Trainer) -> list[str]:
    """The trained tensors holding NaN/Inf on any rank (each rank checks its own shards); the
    names are gathered only when `all_finite`'s one collective finds some."""
    if all_finite(tr.params, tr.info.device):
        return []
    bad = [name for name, p in unwrapped(tr.module).named_parameters() if p.requires_grad
           and not bool(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all())]
    if not dist.is_initialized():
        return bad
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, bad)
    return sorted({name for part in parts for name in part})


def save_run_checkpoint(tr: Trainer, step: int, bad_streak: int) -> None:
    """Checkpoint ``step`` (every rank calls this). NaN/Inf weights are never saved: the last
    checkpoint on disk stays the one to resume (NonFiniteWeights)."""
    bad = _nonfinite(tr)
    if bad:
        raise NonFiniteWeights(f"{len(bad)} trained tensor(s) (e.g. {bad[0]})")
    save_checkpoint(tr.run_dir, step, trainer_state(tr, step, bad_streak),
                    keep=tr.cfg.run.keep_checkpoints)


@dataclass
class Resume:
    """A run's newest intact checkpoint, read before its trainer is built."""

    path: Path
    step: int
    bad_streak: int
    layout: tuple[int, ...]
    chunk_weights: torch.Tensor | None
    state: dict  # the checkpoint's "run" state (`RunState`), decoded


def find_run_checkpoint(run_dir: Path, *, trust: bool = False) -> Resume:
    """The newest intact checkpoint of ``run_dir``, verified against its manifest before
    anything is read (``trust``: one without a manifest too), and its run state. Every rank
    calls this."""
    path = select_checkpoint(run_dir, trust=trust)
    state = read_checkpoint(path, ("run",)).get("run")
    if not isinstance(state, dict) or not set(RunState.JSON) <= set(state):
        raise CheckpointError(f"{path} holds no trainer's run state: it was not written by "
                              "chunk_grpo.train; give a run directory of a training run")
    state.update({key: json.loads(state[key]) for key in RunState.JSON})
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


@dataclass(frozen=True)
class BatchPlan:
    """Per-rank settings that keep a checkpoint's global batch at a new world size."""

    prompts_per_step: int
    grad_accum: int
    message: str | None  # one line for the log; None when nothing changes


def resume_batch_plan(*, saved_world_size: int, saved_prompts_per_step: int,
                      saved_grad_accum: int, world_size: int,
                      requested_prompts_per_step: int | None = None) -> BatchPlan:
    """The per-rank prompts and grad_accum for resuming at ``world_size``.

    Policy: a resumed run keeps the global batch it was saved with (prompts per iteration and
    rows per optimizer step, which the optimizer state and learning-rate schedule were built
    on), so the per-rank prompts and grad_accum scale by saved_world_size / world_size. If they
    cannot, that is an error naming the world sizes that can. Giving prompts_per_step explicitly
    on resume (``requested_prompts_per_step``) changes the global batch on purpose, and the line
    says so.
    """
    same = world_size == saved_world_size
    if requested_prompts_per_step is not None and (
            not same or requested_prompts_per_step != saved_prompts_per_step):
        before = saved_prompts_per_step * saved_world_size
        after = requested_prompts_per_step * world_size
        return BatchPlan(requested_prompts_per_step, saved_grad_accum,
                         f"[chunk-grpo] resuming a {saved_world_size}-rank checkpoint on "
                         f"{world_size} rank(s) with sampling.prompts_per_step "
                         f"{requested_prompts_per_step} as given: the global batch changes from "
                         f"{before} to {after} prompts per iteration")
    if same:
        return BatchPlan(saved_prompts_per_step, saved_grad_accum, None)
    total = saved_prompts_per_step * saved_world_size
    accum_total = saved_grad_accum * saved_world_size  # training calls per step, all ranks
    if total % world_size or accum_total % world_size:
        fits = [n for n in range(1, total + 1)
                if total % n == 0 and accum_total % n == 0]
        raise WorldSizeError(
            f"the checkpoint's global batch ({saved_prompts_per_step} prompts x "
            f"{saved_world_size} ranks = {total} per iteration, optim.grad_accum "
            f"{saved_grad_accum}) "
            f"cannot be split over {world_size} ranks; resume on {', '.join(map(str, fits))} "
            f"rank(s), or pass --sampling.prompts_per_step to change the global batch")
    pps, accum = total // world_size, accum_total // world_size
    accum_note = (f" and optim.grad_accum {saved_grad_accum} -> {accum}" if saved_grad_accum
                  else "")
    return BatchPlan(pps, accum,
                     f"[chunk-grpo] resuming a {saved_world_size}-rank checkpoint on {world_size} "
                     f"rank(s): sampling.prompts_per_step {saved_prompts_per_step} -> {pps} per "
                     f"rank{accum_note}; the global batch stays {total} prompts per iteration")


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
    """Load ``resume`` into a freshly built trainer, whatever world size wrote it (every rank
    calls this). An EMA the checkpoint has none of starts from the restored weights."""
    state = trainer_state(tr, ema="ema" in saved_names(resume.path))
    run = state.pop("run")
    restore_checkpoint(resume.path, state)
    run.load_state_dict(resume.state)
    if tr.ema is not None and "ema" not in state:
        shadow = {name: p.detach().float() for name, p in tr.ema.params.items()}
        tr.ema.load_state_dict({"decay": tr.ema.decay, "shadow": shadow})
