"""The configuration's value checks: every value in its range and the values consistent.

Run by `TrainConfig.validate` after a configuration is built; torch-free (the commands check
their flags before loading a model). Each message names the key as the user wrote it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.reward_spec import RewardSpecError, parse_reward_spec, resolve_guard_spec
from chunk_grpo.config.sampling_options import DECODE_TARGETS, SDE_KINDS, check_antithetic
from chunk_grpo.config.specs import (
    ChunkSpecError,
    GranularityError,
    chunk_sizes,
    export_formats,
    lora_target_modules,
    parse_granularities,
)

if TYPE_CHECKING:
    from chunk_grpo.config.schema import TrainConfig

CHOICES = {
    "sampling.algorithm": ("chunk_grpo", "g2rpo"),
    "sampling.sde": SDE_KINDS,
    "sampling.decode": DECODE_TARGETS,
    "loss.adv_norm": ("group", "global", "none"),
    "reward.mix_advantage": ("total", "per_reward"),
    "loss.kl_ref": ("old", "reference"),
    "optim.name": ("adamw", "adamw8bit"),
    "optim.schedule": ("constant", "cosine"),
    "model.mixed_precision": ("auto", "no", "bf16"),
    "model.attention_backend": ("auto", "native", "flash"),
    "run.device": ("auto", "cpu", "cuda"),
    "parallel.mode": ("ddp", "fsdp", "none"),
    "parallel.reduce_dtype": ("fp32", "bf16"),
    "model.weights_dtype": ("auto", "fp32", "bf16"),
    "model.text_encoders": ("keep", "cache", "cpu"),
    "model.base_quantization": ("none", "nf4", "int8"),
}
REPORT_TO = ("tensorboard", "jsonl", "wandb")  # run.report_to: the logging backends
_AT_LEAST_ONE = ("sampling.steps", "sampling.group_size", "sampling.prompts_per_step",
                 "sampling.batch_size", "optim.micro_batch_size", "optim.ppo_epochs",
                 "chunks.profile_prompts", "chunks.max_size", "eval.images", "eval.final_images",
                 "run.log_every", "run.keep_checkpoints", "run.max_bad_steps")
_AT_LEAST_ZERO = ("run.max_steps", "optim.grad_accum", "optim.warmup_steps", "eval.every",
                  "run.checkpoint_every", "run.image_grid_every", "model.lora_rank",
                  "eval.hybrid_steps", "sampling.sde_window", "reward.batch_size")
_POSITIVE = ("optim.lr", "optim.max_grad_norm", "optim.eps", "loss.adv_eps", "sampling.shift",
             "model.lora_alpha")  # or None where allowed
_NON_NEGATIVE = ("optim.weight_decay", "loss.kl_coef", "sampling.cfg_scale", "model.guidance",
                 "reward.timeout", "eval.guard_stop")


def check_config(cfg: TrainConfig, name: Callable[[str], str]) -> None:
    """Every value in its range and the values consistent; ``name(path)`` names a key."""
    s, lo = cfg.sampling, cfg.loss
    for path, allowed in CHOICES.items():
        if cfg.get(path) not in allowed:
            raise ConfigError(f"{name(path)} must be one of {', '.join(allowed)}; "
                              f"got {cfg.get(path)!r}")
    for low, paths in ((1, _AT_LEAST_ONE), (0, _AT_LEAST_ZERO)):
        for path in paths:
            if cfg.get(path) < low:
                raise ConfigError(f"{name(path)} must be >= {low}, got {cfg.get(path)}")
    if s.steps < 2:
        raise ConfigError(f"{name('sampling.steps')} must be >= 2 (the last step is not "
                          f"trained), got {s.steps}")
    if s.sde_window > s.steps:
        raise ConfigError(f"{name('sampling.sde_window')} {s.sde_window} is beyond the {s.steps} "
                          f"sampling steps ({name('sampling.steps')}); give at most {s.steps - 1} "
                          "(the last step is never trained), or 0 for every step")
    size, spec = cfg.chunks.size, cfg.chunks.spec
    if size is not None and spec not in ("auto", "step"):
        raise ConfigError(f"{name('chunks.spec')} {spec!r} and {name('chunks.size')} {size} both "
                          "set the chunk layout; give one of them")
    if s.group_size < 2 and lo.adv_norm != "none":
        raise ConfigError(f"{name('sampling.group_size')} must be >= 2 for group advantages; "
                          f"set {name('loss.adv_norm')}: none for single samples")
    check_antithetic(s.antithetic_noise, s.group_size, error=ConfigError)
    if not 0.0 < cfg.chunks.fraction <= 1.0:
        raise ConfigError(f"{name('chunks.fraction')} must be in (0, 1], got "
                          f"{cfg.chunks.fraction}")
    if cfg.chunks.size is not None and cfg.chunks.size < 1:
        raise ConfigError(f"{name('chunks.size')} must be >= 1, got {cfg.chunks.size}")
    if not s.eta >= 0.0:
        raise ConfigError(f"{name('sampling.eta')} must be >= 0, got {s.eta}")
    if s.eta == 0.0:
        raise ConfigError(f"{name('sampling.eta')} must be > 0 for training: an SDE step with "
                          "no noise has no log-probability")
    if lo.clip_low < 0 or lo.clip_high < 0 or lo.clip_low >= 1:
        raise ConfigError(f"{name('loss.clip_low')} must be in [0, 1) and "
                          f"{name('loss.clip_high')} >= 0, got {lo.clip_low}, {lo.clip_high}")
    if lo.adv_clip_max is not None and lo.adv_clip_max <= 0:
        raise ConfigError(f"{name('loss.adv_clip_max')} must be > 0 or null, got "
                          f"{lo.adv_clip_max}")
    _check_numbers(cfg, name)
    if not 0.0 <= cfg.optim.ema_decay < 1.0:
        raise ConfigError(f"{name('optim.ema_decay')} must be in [0, 1), got "
                          f"{cfg.optim.ema_decay}")
    if cfg.parallel.reduce_dtype != "fp32" and cfg.parallel.mode != "fsdp":
        raise ConfigError(f"{name('parallel.reduce_dtype')} {cfg.parallel.reduce_dtype} needs "
                          f"{name('parallel.mode')}: fsdp (ddp all-reduces fp32 gradients); set "
                          f"it to fp32 or use fsdp")
    if cfg.run.max_minutes < 0:
        raise ConfigError(f"{name('run.max_minutes')} must be >= 0")
    if not cfg.parallel.timeout_minutes > 0:
        raise ConfigError(f"{name('parallel.timeout_minutes')} must be > 0 minutes (how long "
                          f"ranks wait for each other), got {cfg.parallel.timeout_minutes}; "
                          "e.g. 60")
    _check_specs(cfg, name)
    _check_guard(cfg, name)
    _check_quantization(cfg, name)


def _check_guard(cfg: TrainConfig, name: Callable[[str], str]) -> None:
    """The guard reward parses, and an early stop on it can happen: a guard to watch, periodic
    evaluations, the base model to compare with, and images enough for a confidence interval."""
    key, stop = name("eval.guard_reward"), name("eval.guard_stop")
    guard = cfg.eval.guard_reward
    if guard.strip().lower() not in ("auto", "none"):
        try:
            parse_reward_spec(guard)
        except RewardSpecError as err:
            raise ConfigError(f"{key}: {err} (or auto, or none for no guard)") from None
    threshold = cfg.eval.guard_stop
    if threshold <= 0:
        return
    spec = resolve_guard_spec(guard, reward=cfg.reward.name, eval_prompts=cfg.data.eval_prompts)
    if spec is None:
        why = ("none" if guard.strip().lower() == "none" else
               "auto, which finds no guard here (it is the shapes checks on shapes: evaluation "
               "prompts when the trained reward is not shapes)")
        raise ConfigError(f"{stop} {threshold:g} has no guard to watch: {key} is {why}; name "
                          f"one (e.g. {key}: shapes) or set {stop}: 0")
    if cfg.eval.every == 0:
        raise ConfigError(f"{stop} {threshold:g} is checked at the periodic evaluations, and "
                          f"{name('eval.every')}: 0 runs none; set {name('eval.every')} >= 1 "
                          f"or {stop}: 0")
    if cfg.eval.hybrid_steps == 0:
        raise ConfigError(f"{stop} {threshold:g} compares the guard with the base model's on the "
                          f"same images, and {name('eval.hybrid_steps')}: 0 loads no base; set "
                          f"{name('eval.hybrid_steps')} >= 1 (e.g. 8) or {stop}: 0")
    if cfg.eval.images < 2:
        raise ConfigError(f"{stop} {threshold:g} needs a confidence interval of the guard's "
                          f"change: set {name('eval.images')} >= 2 (e.g. 32), got "
                          f"{cfg.eval.images}")


def _check_quantization(cfg: TrainConfig, name: Callable[[str], str]) -> None:
    """A quantized base is QLoRA: adapters on frozen bitsandbytes layers, never sharded."""
    kind = cfg.model.base_quantization
    if kind == "none":
        return
    key = name("model.base_quantization")
    if cfg.model.lora_rank == 0:
        raise ConfigError(f"{key} {kind} needs {name('model.lora_rank')} > 0: the quantized "
                          f"base is frozen and only LoRA adapters train on it (QLoRA); set "
                          f"e.g. {name('model.lora_rank')}: 64, or {key}: none")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"{key} {kind} needs bitsandbytes: pip install bitsandbytes, or set "
                          f"{key}: none")
    if cfg.parallel.mode == "fsdp":
        raise ConfigError(f"{key} {kind} cannot be sharded with {name('parallel.mode')}: fsdp "
                          f"(FSDP2 shards parameters as DTensors, which drops bitsandbytes' "
                          f"quantized weight class and its quantization state); use "
                          f"{name('parallel.mode')}: none on one GPU or ddp")


def _check_numbers(cfg: TrainConfig, name: Callable[[str], str]) -> None:
    """Every float finite (``lr: nan`` or ``--lr inf`` would train NaN weights), and each in
    its range."""
    for section, values in dataclasses.asdict(cfg).items():
        for key, value in values.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{name(f'{section}.{key}')} must be a finite number, got "
                                  f"{value}")
    for paths, bad, rule in ((_POSITIVE, lambda v: v <= 0, "> 0"),
                             (_NON_NEGATIVE, lambda v: v < 0, ">= 0")):
        for path in paths:
            value = cfg.get(path)
            if value is not None and bad(value):
                raise ConfigError(f"{name(path)} must be {rule}, got {value}")
    for path in ("optim.beta1", "optim.beta2"):
        if not 0.0 <= cfg.get(path) < 1.0:
            raise ConfigError(f"{name(path)} must be in [0, 1), got {cfg.get(path)}")
    for path in ("model.height", "model.width"):
        value = cfg.get(path)
        if value is not None and value < 16:
            raise ConfigError(f"{name(path)} must be >= 16 pixels or null (the model's size), "
                              f"got {value}")


def _check_specs(cfg: TrainConfig, name: Callable[[str], str]) -> None:
    """The string settings parse: the reward spec, the device, the chunks, the granularities."""
    try:
        parse_reward_spec(cfg.reward.name)
    except RewardSpecError as err:
        raise ConfigError(f"{name('reward.name')}: {err}") from None
    if not re.fullmatch(r"|cpu|cuda(:\d+)?", cfg.reward.device):
        raise ConfigError(f"{name('reward.device')} must be '' (the trainer's device), cpu, "
                          f"cuda or cuda:N; got {cfg.reward.device!r}")
    try:
        chunk_sizes(cfg.chunks.spec, cfg.num_trained, cfg.chunks.size)
    except ChunkSpecError as err:
        raise ConfigError(f"{name('chunks.spec')}: {err}") from None
    try:
        parse_granularities(cfg.sampling.g2rpo_granularities)
    except GranularityError as err:
        raise ConfigError(f"{name('sampling.g2rpo_granularities')}: {err}") from None
    if cfg.model.lora_rank > 0:  # a preset name, or module names (not both)
        try:
            lora_target_modules(cfg.model.lora_targets)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    try:
        export_formats(cfg.run.export, cfg.model.lora_rank > 0)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_report_to(cfg.run.report_to)
    if cfg.sampling.algorithm == "g2rpo" and not cfg.sampling.shared_noise:
        raise ConfigError(f"{name('sampling.algorithm')} g2rpo branches one ODE trajectory per "
                          f"prompt, so the group shares its initial noise: set "
                          f"{name('sampling.shared_noise')}: true")


def _check_report_to(backends: list[str]) -> None:
    """Known logging backends; wandb installed when asked for (it is an optional extra)."""
    unknown = [b for b in backends if b not in REPORT_TO]
    if unknown:
        raise ConfigError(f"run.report_to: {unknown[0]!r} is not a logging backend; give any of "
                          f"{', '.join(REPORT_TO)}")
    if "wandb" in backends and importlib.util.find_spec("wandb") is None:
        raise ConfigError("run.report_to: wandb is not installed; pip install 'chunk-grpo[wandb]' "
                          "(or wandb>=0.17), or drop wandb from run.report_to")
