"""Chunk-GRPO training: ``python -m chunk_grpo.train`` (see ``--help``).

With no arguments it fine-tunes the embedded tiny FLUX on the shapes reward on the CPU;
``--config configs/flux_dev_hpsv3.yaml`` under torchrun trains FLUX.1-dev with the paper's settings.

One iteration, in the order it runs (`train_iteration`):
  1. sample prompts (rank-aware)
  2. group rollouts with the SDE sampler, storing every latent x_t and log-prob
  3. decode and score the images (each rollout batch while the next is sampled; a mix of
     rewards gives each reward's scores and their weighted total)
  4. group-relative advantages (of the total, or of each reward, then weighted and summed)
  5. choose the chunks to train (all, or a fraction drawn uniformly / by dynamics weight)
  6. train chunk by chunk (one batched transformer call per chunk and micro-batch), with
     optimizer steps every `grad_accum` calls
  7. log; every N iterations evaluate on held-out prompts and checkpoint.
With ``algorithm: g2rpo`` step 2 branches each prompt's ODE trajectory at one step and finishes
the branches at several strides (`chunk_grpo.branching`), step 4 sums the finishes' advantages,
and step 5 trains that one step.
Simplifications: gradients are averaged across ranks by an all-reduce after backward (no DDP
overlap). The hybrid-evaluation base comes from the policy's own weights (`chunk_grpo.hybrid_base`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from chunk_grpo import distributed as D
from chunk_grpo.advantages import multi_granularity_advantages, per_reward_advantages
from chunk_grpo.branching import parse_granularities, sample_branch_rollouts
from chunk_grpo.checkpoint import (
    DiskFullError,
    latest_checkpoint,
    load_checkpoint,
    nonfinite_tensors,
    save_checkpoint,
)
from chunk_grpo.chunking import ChunkLayout, parse_chunk_spec, select_chunks
from chunk_grpo.config import (
    ConfigError,
    RunInterrupted,
    TrainConfig,
    build_config,
    load_yaml,
    parse_args,
    run_cli,
    save_config,
)
from chunk_grpo.hybrid_base import hybrid_base
from chunk_grpo.metrics import MetricsLogger, reward_captions, save_image_grid
from chunk_grpo.optim import EMA, build_lr_scheduler, build_optimizer
from chunk_grpo.policy_setup import (
    export_pipeline,
    load_trainable_state_dict,
    prepare_transformer,
    trainable_state_dict,
)
from chunk_grpo.policy_update import optimizer_step_after, plan_units, update_policy
from chunk_grpo.precision import resolve_mixed_precision
from chunk_grpo.profile import measure_dynamics, propose_chunks, save_profile
from chunk_grpo.prompt_cache import setup_text_encoders, text_encoder_device
from chunk_grpo.prompts import PromptSet, check_prompts, load_prompt_set, load_prompts
from chunk_grpo.rewards import get_reward
from chunk_grpo.rewards.mix import RewardMix, as_reward_mix
from chunk_grpo.rewards.outputs import RewardError
from chunk_grpo.rollout import sample_rollouts
from chunk_grpo.run_lock import RunLock
from chunk_grpo.schedule import dynamic_shift
from chunk_grpo.scoring import RolloutScorer, constant_within_groups, probe_reward
from chunk_grpo.stats import mean_ci95
from chunk_grpo.summary import Comparison, before_after_grid, save_summary, summary_text
from chunk_grpo.weights_dtype import load_dtypes, resolve_weights_dtype

GRID_IMAGES = 32  # evaluation images kept for grids (the rest are dropped after scoring)


class TrainingDiverged(RuntimeError):
    """Too many consecutive iterations with NaN/Inf rewards, losses or gradients."""


@dataclass
class Trainer:
    """Everything an iteration touches."""

    cfg: TrainConfig
    info: D.DistInfo
    run_dir: Path
    policy: object
    params: list
    optimizer: torch.optim.Optimizer
    scheduler: object
    ema: EMA | None
    reward_fn: RewardMix
    train_prompts: list[str]
    eval_prompts: list[str]
    layout: ChunkLayout
    chunk_weights: torch.Tensor | None
    logger: MetricsLogger
    base_policy: object = None  # frozen base for hybrid evaluation
    fidelity_fn: object = None  # a reward with `details` reported beside the trained one
    base_evals: dict = field(default_factory=dict)  # image count -> the base's EvalResult
    final_evals: dict = field(default_factory=dict)  # "eval"/"eval_hybrid" -> final EvalResult
    warned_constant: set[str] = field(default_factory=set)  # rewards warned of as constant

    @property
    def shift(self) -> float:
        return sampling_shift(self.cfg, self.policy)

    @property
    def cfg_scale(self) -> float:
        c = self.cfg.cfg_scale
        return self.policy.default_cfg_scale if c is None else c


# ----------------------------------------------------------------------------- one iteration

class _PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[f"time/{name}"] = time.perf_counter() - start


def train_iteration(tr: Trainer, step: int) -> tuple[dict, bool]:
    """One Chunk-GRPO (or G2RPO) iteration; returns (metrics, finite) -- finite False = step
    skipped."""
    cfg, info, timer = tr.cfg, tr.info, _PhaseTimer()

    # 1. prompts for this rank
    prompts = D.sample_prompts(tr.train_prompts, cfg.prompts_per_step, seed=cfg.seed, step=step,
                               info=info)

    # 2. group rollouts with the SDE sampler (latents and log-probs stored); G2RPO: one branch
    #    step k (a step-level chunk drawn as chunks are), its group finished at several strides
    gen = D.step_generator(cfg.seed, step, info.rank, "chunks")
    weights = tr.chunk_weights if cfg.weighted_chunks else None
    strides = parse_granularities(cfg.g2rpo_granularities) if cfg.algorithm == "g2rpo" else (1,)
    rollout_gen = D.step_generator(cfg.seed, step, info.rank, "rollout")
    common = dict(group_size=cfg.group_size, num_steps=cfg.num_steps, shift=tr.shift,
                  kind=cfg.sde_kind, eta=cfg.eta, cfg_scale=tr.cfg_scale,
                  generator=rollout_gen, batch_size=cfg.rollout_batch_size,
                  antithetic_noise=cfg.antithetic_noise, decode=cfg.decode,
                  mixed_precision=cfg.mixed_precision)
    with RolloutScorer(tr.reward_fn, overlap=cfg.reward_overlap) as scorer:
        with timer("rollout"):
            if cfg.algorithm == "g2rpo":
                chunks = select_chunks(tr.layout.num_chunks, 1 / tr.layout.num_chunks,
                                       weights=weights, generator=gen)
                rollout, finishes = sample_branch_rollouts(
                    tr.policy, prompts, branch_step=chunks[0], granularities=strides, **common)
            else:  # 3. begins here: each batch is scored while the next is sampled
                rollout = sample_rollouts(tr.policy, prompts, shared_noise=cfg.shared_noise,
                                          sde_window=cfg.sde_window, on_batch=scorer, **common)

        # 3. score the decoded images (every finish): each reward's scores, and the total
        row_prompts = [prompts[i] for i in rollout.prompt_index.tolist()]
        with timer("reward"):
            if cfg.algorithm == "g2rpo":
                components = [scorer.score_now(images, row_prompts) for images in finishes]
            else:
                components = [scorer.collect()]
    scores = [tr.reward_fn.total(c) for c in components]
    gathered = [D.all_gather_cat(r.to(info.device), info).cpu() for r in scores]
    gathered_parts = [{k: D.all_gather_cat(v.to(info.device), info).cpu() for k, v in c.items()}
                      for c in components]
    all_rewards = gathered[0]
    metrics = {"reward_mean": float(all_rewards.mean()), "reward_std": float(all_rewards.std()),
               "lr": tr.optimizer.param_groups[0]["lr"]}
    for label, r in gathered_parts[0].items():
        metrics[f"reward/{label}_mean"] = float(r.mean())
        metrics[f"reward/{label}_std"] = float(r.std())
    for stride, r in zip(strides[1:], gathered[1:], strict=True):
        metrics[f"reward_mean_stride{stride}"] = float(r.mean())
    metrics["time/reward_scoring"] = scorer.busy_seconds
    if not all(bool(torch.isfinite(r).all()) for r in
               [*gathered, *(v for c in gathered_parts for v in c.values())]):
        metrics.update(timer.seconds, skipped=1, nonfinite="reward")
        return metrics, False
    if info.is_main:
        _warn_if_constant(tr, gathered_parts[0], step)

    # 4. group-relative advantages (G2RPO: summed over the finishes)
    if cfg.mix_advantage == "per_reward":
        terms = [(tr.reward_fn.weights[label], r, pool[label])
                 for c, pool in zip(components, gathered_parts, strict=True)
                 for label, r in c.items()]
        advantages = per_reward_advantages(terms, cfg.group_size, norm=cfg.adv_norm,
                                           eps=cfg.adv_eps, clip_max=cfg.adv_clip_max)
    else:
        advantages = multi_granularity_advantages(scores, cfg.group_size, norm=cfg.adv_norm,
                                                  eps=cfg.adv_eps, clip_max=cfg.adv_clip_max,
                                                  all_rewards=gathered)
    metrics.update(adv_mean=float(advantages.mean()), adv_std=float(advantages.std()),
                   adv_abs_max=float(advantages.abs().max()))

    # 5. choose chunks (G2RPO: the branch step's), and the (chunk, micro-batch) training units
    if cfg.algorithm != "g2rpo":
        chunks = select_chunks(tr.layout.num_chunks, cfg.chunk_fraction, weights=weights,
                               generator=gen)
    units = plan_units(chunks, rollout.latents.shape[0], cfg.micro_batch_size, gen)
    metrics["chunks_trained"] = ",".join(str(j) for j in chunks)

    # 6. train chunk by chunk; optimizer steps every grad_accum units
    with timer("train"):
        result = update_policy(
            tr.policy, tr.params, tr.optimizer, tr.scheduler, rollout,
            rollout.prompt_embeds, advantages.to(info.device), units,
            [tr.layout.steps(j) for j in range(tr.layout.num_chunks)], cfg,
            cfg_scale=tr.cfg_scale, ema=tr.ema, reduce_grads=D.make_grad_reducer(info))

    # 7. metrics of the update
    metrics.update(
        loss=_mean(result.losses), grad_norm=_mean(result.grad_norms),
        optimizer_steps=result.optimizer_steps, skipped=result.skipped_steps,
        rollout_logp_gap=result.rollout_logp_gap)
    for j, stats in sorted(result.chunk_stats.items()):
        for name, values in stats.items():
            metrics[f"chunk{j}/{name}"] = _mean(values)
    for name in ("approx_kl", "clip_frac", "ratio_mean", "ref_kl"):
        values = [v for s in result.chunk_stats.values() for v in s.get(name, [])]
        if values:
            metrics[name] = _mean(values)
    metrics.update(timer.seconds)
    if tr.cfg.image_grid_every and step % tr.cfg.image_grid_every == 0 and info.is_main:
        save_image_grid(rollout.images, tr.run_dir / "images" / f"rollout-{step:06d}.png",
                        reward_captions(row_prompts, scores[0]), columns=cfg.group_size)
    return metrics, result.skipped_steps == 0


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def _warn_if_constant(tr: Trainer, rewards: dict[str, torch.Tensor], step: int) -> None:
    """Warn once per reward that scores every image of each group alike: its advantages are all
    zero, so it gives no learning signal."""
    for c in tr.reward_fn.components:
        if c.label in tr.warned_constant or not constant_within_groups(rewards[c.label],
                                                                       tr.cfg.group_size):
            continue
        tr.warned_constant.add(c.label)
        tqdm.write(f"[chunk-grpo] warning: reward {c.name!r} gave the same score to every image "
                   f"of each group at step {step + 1}: its advantages are all 0, so it gives no "
                   f"learning signal. Check that it depends on the images (python -m "
                   f"chunk_grpo.gradient_snr --reward {c.name})")


# ----------------------------------------------------------------------------- evaluation

def evaluate(tr: Trainer, step: int, final: bool = False) -> dict:
    """Held-out reward with 95% CI (ODE sampling with the model's default steps and shift, EMA
    weights if any), and hybrid inference; with a fidelity reward (the shapes checks on shapes
    prompts) its per-attribute accuracies too. With the base model at hand, also the paired gain
    over it: the same images (prompts and initial noise) sampled by the base, once per image
    count. ``final``: `final_eval_images` images, kept in ``tr.final_evals`` for the summary."""
    from chunk_grpo.evaluate import evaluate_policy

    cfg, out = tr.cfg, {}
    count = cfg.final_eval_images if final else cfg.eval_images
    prompts = [tr.eval_prompts[i % len(tr.eval_prompts)] for i in range(count)]
    settings = dict(reward=tr.reward_fn, fidelity=tr.fidelity_fn, seed=cfg.seed + 1,
                    cfg_scale=tr.cfg_scale, batch_size=cfg.rollout_batch_size)
    if tr.base_policy is not None and count not in tr.base_evals:
        base = evaluate_policy(tr.base_policy, prompts, **settings)
        tr.base_evals[count] = dataclasses.replace(base, images=base.images[:GRID_IMAGES])
    base_eval = tr.base_evals.get(count)
    if tr.ema is not None:
        tr.ema.swap()
    try:
        runs = [("eval", None, 0)]
        if cfg.eval_hybrid_steps and tr.base_policy is not None:
            runs.append(("eval_hybrid", tr.base_policy, cfg.eval_hybrid_steps))
        for name, base, k in runs:
            # The model's own sampling defaults, as `python -m chunk_grpo.evaluate` uses them.
            res = evaluate_policy(tr.policy, prompts, hybrid_base=base, hybrid_steps=k,
                                  **settings)
            out[f"{name}/reward_mean"] = res.reward_mean
            out[f"{name}/reward_ci95"] = res.reward_ci95
            out.update({f"{name}/{key}": value for key, value in res.attributes.items()})
            if base_eval is not None:
                gain, gain_ci = mean_ci95(res.rewards - base_eval.rewards)
                out[f"{name}/gain_vs_base"], out[f"{name}/gain_ci95"] = gain, gain_ci
            if final:
                tr.final_evals[name] = dataclasses.replace(res, images=res.images[:GRID_IMAGES])
            if tr.info.is_main:
                save_image_grid(res.images[:32], tr.run_dir / "images" / f"{name}-{step:06d}.png",
                                reward_captions(res.prompts[:32], res.rewards[:32]))
    finally:
        if tr.ema is not None:
            tr.ema.swap()
    return out


def finish_summary(tr: Trainer, iterations: int, minutes: float, model_dir: Path | None) -> str:
    """The run's closing screen (before -> after on the final evaluation), saved in the run
    directory with a before/after grid."""
    base = tr.base_evals.get(tr.cfg.final_eval_images)
    comparisons = [] if base is None else [
        Comparison.of(name, base, res) for name, res in tr.final_evals.items()]
    text = summary_text(run_dir=tr.run_dir, reward=tr.cfg.reward, comparisons=comparisons,
                        iterations=iterations, minutes=minutes,
                        hybrid_steps=tr.cfg.eval_hybrid_steps, model_dir=model_dir)
    save_summary(tr.run_dir, text, comparisons)
    if base is not None and "eval" in tr.final_evals:
        before_after_grid(base, tr.final_evals["eval"], tr.run_dir / "images" / "before_after.png")
    return text


# ----------------------------------------------------------------------------- setup

def _prompt_list(spec: str) -> list[str]:
    return load_prompts(spec)


def read_prompt_sets(cfg: TrainConfig) -> dict[str, PromptSet]:
    """Read and decode both prompt sets: the first thing a run checks, before any model loads,
    so a missing or unreadable file is reported at once."""
    sets = {}
    for key in ("train_prompts", "eval_prompts"):
        try:
            sets[key] = load_prompt_set(getattr(cfg, key))
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}") from None
    return sets


def check_prompt_sets(prompt_sets: dict[str, PromptSet], policy, reward_fn) -> None:
    """Run both prompt sets through the tokenizers and the reward before the run directory
    exists: a prompt they cannot take fails now, not at the final evaluation."""
    for key, prompt_set in prompt_sets.items():
        try:
            notes = check_prompts(prompt_set, policy, reward_fn)
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}") from None
        for note in notes:
            print(f"[chunk-grpo] {key}: {note}", flush=True)


def sampling_shift(cfg: TrainConfig, policy) -> float:
    """The rollouts' sigma shift: ``cfg.shift``, or with ``dynamic_shift`` FLUX's
    resolution-dependent exp(mu) from the image's latent token count."""
    if not cfg.dynamic_shift:
        return cfg.shift
    rows, cols = policy.latent_grid()
    return dynamic_shift(rows * cols)


def _model_path(spec: str) -> str:
    from chunk_grpo.models import EMBEDDED_MODEL

    return str(EMBEDDED_MODEL) if spec == "embedded" else spec


def load_policy(cfg: TrainConfig, device: torch.device):
    from chunk_grpo.models import FluxPolicy
    from chunk_grpo.models.sampling_defaults import apply_sampling_size

    # [memory] frozen parts in weights_dtype, text encoders where text_encoders puts them
    dtype, frozen_dtype = load_dtypes(cfg.weights_dtype, device, cfg.lora_rank)
    policy = FluxPolicy.from_pretrained(
        _model_path(cfg.model), device=device, dtype=dtype, frozen_dtype=frozen_dtype,
        text_encoder_device=text_encoder_device(cfg.text_encoders, device))
    try:
        apply_sampling_size(policy, cfg.height, cfg.width, source=_model_path(cfg.model),
                            found_file=policy.sampling_file_found,
                            how="height and width (--height H --width W, or in the YAML)")
        policy.set_guidance(cfg.guidance)  # [memory] the guidance config field
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return policy


def resolve_layout(cfg: TrainConfig, policy, run_dir: Path, info: D.DistInfo
                   ) -> tuple[ChunkLayout, torch.Tensor | None]:
    """The run's fixed chunk layout; "auto" (or weighted sampling) measures the profile.
    G2RPO trains one branch step per iteration: its layout is step level, chunk j = step j."""
    if cfg.algorithm == "g2rpo":
        layout = ChunkLayout((1,) * cfg.num_trained)
    else:
        layout = parse_chunk_spec(cfg.chunks, cfg.num_trained, cfg.chunk_size)
    curve = None
    if layout is None or cfg.weighted_chunks:
        prompts = _prompt_list(cfg.train_prompts)[:cfg.profile_prompts]
        curve = measure_dynamics(policy, prompts, num_steps=cfg.num_steps,
                                 shift=sampling_shift(cfg, policy),
                                 cfg_scale=cfg.cfg_scale, seed=cfg.seed,
                                 batch_size=cfg.rollout_batch_size)
        if layout is None:
            layout = propose_chunks(curve, cfg.max_chunk_size, cfg.num_trained)
        if info.is_main:
            save_profile(curve, layout, run_dir)
    return layout, curve


def _default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def resolve_reward(cfg: TrainConfig, device: torch.device | None = None) -> RewardMix:
    """The configured reward (or mix) on ``reward_device`` (default: ``device``, the trainer's),
    in bf16 on CUDA and fp32 elsewhere; or a ConfigError that says how to name one."""
    from chunk_grpo.rewards import build_reward

    where = torch.device(cfg.reward_device or device or "cpu")
    dtype = torch.bfloat16 if where.type == "cuda" else torch.float32
    try:
        return build_reward(cfg.reward, device=where, dtype=dtype,
                            batch_size=cfg.reward_batch_size)
    except RewardError:
        raise
    except ValueError as err:
        raise ConfigError(f"reward: {err}") from err


def check_reward(cfg: TrainConfig, reward: RewardMix, policy) -> None:
    """Call the rewards once on a probe batch (2 images of the model's size, the first training
    prompts): a reward that fails or returns the wrong thing stops here, before the run
    directory exists, in one line."""
    probe_reward(reward, policy.height, policy.width, _prompt_list(cfg.train_prompts))


def load_checked_policy(cfg: TrainConfig, device: torch.device):
    """The policy, once the config is known to suit it (checked here, not at the first
    evaluation, which may come only at the end of the run). Seeds torch first: what follows
    (the profile, LoRA's initialisation) draws from the seeded generator."""
    torch.manual_seed(cfg.seed)
    policy = load_policy(cfg, device)
    eval_steps = policy.defaults.num_steps  # evaluation samples as `chunk_grpo.evaluate` does
    if cfg.eval_hybrid_steps > eval_steps:
        raise ConfigError(f"eval_hybrid_steps={cfg.eval_hybrid_steps} exceeds the {eval_steps} "
                          f"steps evaluation samples with (the model's default num_steps); set "
                          f"--eval-hybrid-steps to at most {eval_steps}, or 0 to skip hybrid "
                          f"evaluation")
    return policy


def build_trainer(cfg: TrainConfig, run_dir: Path, info: D.DistInfo,
                  layout: ChunkLayout | None = None, curve: torch.Tensor | None = None,
                  reward_fn=None, policy=None) -> Trainer:
    """Everything an iteration needs; ``reward_fn`` and ``policy`` are built from the config
    unless given."""
    reward_fn = resolve_reward(cfg, info.device) if reward_fn is None else as_reward_mix(
        reward_fn, cfg.reward)
    if policy is None:
        policy = load_checked_policy(cfg, info.device)
    if layout is None:
        layout, curve = resolve_layout(cfg, policy, run_dir, info)
    params = prepare_transformer(
        policy.transformer, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
        lora_targets=cfg.lora_targets, gradient_checkpointing=cfg.gradient_checkpointing,
        attention_backend=cfg.attention_backend)
    optimizer = build_optimizer(params, name=cfg.optimizer, lr=cfg.lr,
                                betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                weight_decay=cfg.weight_decay)
    rows = cfg.prompts_per_step * cfg.group_size
    units = math.ceil(rows / cfg.micro_batch_size) * max(
        1, round(cfg.chunk_fraction * layout.num_chunks))
    steps_per_iter = sum(optimizer_step_after(units, cfg.grad_accum)) * cfg.ppo_epochs
    scheduler = build_lr_scheduler(optimizer, warmup_steps=cfg.warmup_steps,
                                   total_steps=cfg.max_steps * steps_per_iter,
                                   kind=cfg.lr_schedule)
    ema = None
    if cfg.ema_decay > 0:
        ema = EMA([(n, p) for n, p in policy.transformer.named_parameters() if p.requires_grad],
                  cfg.ema_decay)
    base = None
    if cfg.eval_hybrid_steps:  # [memory] the base from the same weights, before any step
        base = hybrid_base(policy, resolve_weights_dtype(cfg.weights_dtype, info.device))
    weights = layout.chunk_weights(curve) if curve is not None else None
    # On shapes prompts, the shapes world's checks say whether a learned reward's gain kept
    # prompt fidelity (colour, shape, count, position) or came from reward hacking.
    fidelity = get_reward("shapes") if cfg.eval_prompts.startswith("shapes:") else None
    return Trainer(cfg=cfg, info=info, run_dir=run_dir, policy=policy, params=params,
                   optimizer=optimizer, scheduler=scheduler, ema=ema,
                   reward_fn=reward_fn, train_prompts=_prompt_list(cfg.train_prompts),
                   eval_prompts=_prompt_list(cfg.eval_prompts), layout=layout,
                   chunk_weights=weights, logger=MetricsLogger(run_dir, enabled=info.is_main),
                   base_policy=base, fidelity_fn=fidelity)


def _checkpoint_state(tr: Trainer, bad_streak: int) -> dict:
    return {
        "model": trainable_state_dict(tr.policy.transformer),
        "optimizer": tr.optimizer.state_dict(),
        "scheduler": tr.scheduler.state_dict(),
        "ema": tr.ema.state_dict() if tr.ema is not None else None,
        "bad_streak": bad_streak,
        "chunk_layout": list(tr.layout.sizes),
        "chunk_weights": tr.chunk_weights,
        "config": tr.cfg.to_dict(),
    }


def _restore(tr: Trainer, state: dict) -> None:
    load_trainable_state_dict(tr.policy.transformer, state["model"])
    tr.optimizer.load_state_dict(state["optimizer"])
    tr.scheduler.load_state_dict(state["scheduler"])
    if tr.ema is not None and state.get("ema") is not None:
        tr.ema.load_state_dict(state["ema"])


# ----------------------------------------------------------------------------- the run

def run(cfg: TrainConfig, *, run_dir: str | Path | None = None, resume: bool = False,
        on_step_end=None) -> Path:
    """Train; returns the run directory (with final_model/ exported at the end).

    ``on_step_end(step, metrics)`` is called after every iteration (e.g. to stop early).
    """
    # Before the run directory: a bad prompt file, a misspelt or failing reward or a bad model
    # path leaves nothing behind.
    prompt_sets = read_prompt_sets(cfg)
    info = D.init_distributed(cfg.device)
    reward_fn = resolve_reward(cfg, info.device)
    policy = load_checked_policy(cfg, info.device)
    check_prompt_sets(prompt_sets, policy, reward_fn)
    check_reward(cfg, reward_fn, policy)
    # [memory] text_encoders: cache -> every prompt embedded once (on disk), encoders freed
    setup_text_encoders(policy, cfg.text_encoders,
                        [p for s in prompt_sets.values() for p in s.prompts],
                        cfg.prompt_cache_dir, info, progress=cfg.progress)
    run_dir = Path(run_dir or cfg.output_dir or _default_run_dir())
    lock = RunLock(run_dir)
    if info.is_main:
        if not resume and (run_dir / "checkpoints").exists():
            raise ConfigError(f"{run_dir} already holds a run; pass --resume {run_dir} to "
                              "continue it or choose another output_dir")
        _make_run_dir(run_dir)
        lock.acquire()  # a second run on this directory stops here, before writing anything
    try:
        tr, start, bad_streak = _start_or_resume(cfg, run_dir, info, resume, reward_fn, policy)
        if info.is_main:
            print(f"[chunk-grpo] run dir {run_dir}; chunks {list(tr.layout.sizes)}; "
                  f"steps {start}..{cfg.max_steps}", flush=True)
            precision = resolve_mixed_precision(cfg.mixed_precision, info.device)
            print(f"[chunk-grpo] mixed precision: {precision.mode} ({precision.reason})",
                  flush=True)
        _train_loop(tr, start, bad_streak, on_step_end)
        tr.logger.close()
    except KeyboardInterrupt:
        last = latest_checkpoint(run_dir)
        where = (f"resume from {last} with --resume {run_dir}" if last is not None else
                 "no checkpoint was written yet")
        raise RunInterrupted(f"interrupted (Ctrl-C); {where}") from None
    finally:
        lock.release()
    return run_dir


def _start_or_resume(cfg: TrainConfig, run_dir: Path, info: D.DistInfo, resume: bool,
                     reward_fn, policy) -> tuple[Trainer, int, int]:
    """The trainer, fresh or restored from the newest intact checkpoint; (trainer, first step,
    bad streak)."""
    start, bad_streak, state = 0, 0, None
    layout = curve = None
    if resume:
        state = load_checkpoint(run_dir)
        start, bad_streak = state["step"], state["bad_streak"]
        layout = ChunkLayout(tuple(state["chunk_layout"]))
        curve_weights = state["chunk_weights"]
    elif info.is_main:
        if (run_dir / "checkpoints").exists():  # another run got here first
            raise ConfigError(f"{run_dir} already holds a run; pass --resume {run_dir} to "
                              "continue it or choose another output_dir")
        save_config(cfg, run_dir / "config.yaml")
    D.barrier(info)
    tr = build_trainer(cfg, run_dir, info, layout=layout, curve=curve, reward_fn=reward_fn,
                       policy=policy)
    if state is not None:
        tr.chunk_weights = curve_weights
        _restore(tr, state)
        tr.logger.truncate_after(start)
        if info.is_main:
            save_config(cfg, run_dir / "config.yaml")
    return tr, start, bad_streak


def _make_run_dir(run_dir: Path) -> None:
    """Create the run directory, or say in one line why it cannot be written."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write the output directory {run_dir}: "
                          f"{err.strerror or err} ({err.filename or run_dir}); choose a writable "
                          f"output_dir") from None


def _train_loop(tr: Trainer, start: int, bad_streak: int, on_step_end) -> None:
    """Iterations ``start`` .. max_steps: train, evaluate, log, checkpoint; export at the end."""
    cfg, info, run_dir = tr.cfg, tr.info, tr.run_dir
    t_start = time.time()
    bar = tqdm(range(start, cfg.max_steps), initial=start, total=cfg.max_steps,
               disable=not (cfg.progress and info.is_main), desc="chunk-grpo")
    step = start
    for step in bar:
        try:
            metrics, finite = train_iteration(tr, step)
            bad_streak = 0 if finite else bad_streak + 1
            done = step + 1 == cfg.max_steps or (
                cfg.max_minutes > 0 and time.time() - t_start > 60 * cfg.max_minutes)
            if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or done:
                t = time.perf_counter()
                metrics.update(evaluate(tr, step + 1, final=done))
                metrics["time/eval"] = time.perf_counter() - t
        except RewardError as err:  # one line on the command line, naming what is kept
            raise type(err)(f"{err}; the run stopped at step {step + 1}, "
                            f"{_kept_checkpoint(run_dir)}") from err
        if (step + 1) % cfg.log_every == 0 or done or not finite:
            tr.logger.log(step + 1, metrics)
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}")
        if bad_streak >= cfg.max_bad_steps:
            raise TrainingDiverged(
                f"{bad_streak} iterations in a row had NaN/Inf rewards, losses or gradients "
                f"(last at step {step + 1}); stopping, {_kept_checkpoint(run_dir)}; lower lr "
                f"or clip ranges, or check the reward.")
        if finite and ((cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)
                       or done):
            state = _checkpoint_state(tr, bad_streak)
            _refuse_nonfinite(state, step + 1, run_dir)  # every rank: all hold the same weights
            if info.is_main:
                save_checkpoint(run_dir, step + 1, state, keep=cfg.keep_checkpoints)
            D.barrier(info)
        if on_step_end is not None:
            on_step_end(step + 1, metrics)
        if done:
            break
    if info.is_main:
        try:
            model_dir = export_final(tr)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            raise DiskFullError(errno.ENOSPC, f"no space left on device to export "
                                f"{run_dir / 'final_model'}; the last checkpoint "
                                f"{latest_checkpoint(run_dir)} is kept: free some space and run "
                                f"--resume {run_dir} to export it") from None
        text = finish_summary(tr, step + 1 - start, (time.time() - t_start) / 60, model_dir)
        if cfg.progress:
            print(text, flush=True)


def _refuse_nonfinite(state: dict, step: int, run_dir: Path) -> None:
    """Never checkpoint NaN/Inf weights; the last checkpoint on disk stays the one to resume."""
    bad = nonfinite_tensors(state["model"])
    if bad:
        last = latest_checkpoint(run_dir)
        kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
        raise TrainingDiverged(
            f"{len(bad)} trained tensor(s) (e.g. {bad[0]}) hold NaN/Inf at step {step}; they are "
            f"not saved and {kept}. Lower lr or max_grad_norm and resume or restart.")


def _kept_checkpoint(run_dir: Path) -> str:
    """Where the run can be resumed from, for the messages of a run that stops early."""
    last = latest_checkpoint(run_dir)
    if last is None:
        return "and no checkpoint was written yet (nothing to resume)"
    return f"its last checkpoint {last} is intact (resume with --resume {run_dir})"


def export_final(tr: Trainer) -> Path:
    """final_model/: a diffusers directory (EMA weights if enabled, LoRA merged)."""
    if not tr.policy.has_text_encoders:  # [memory] freed after caching: the export needs them
        tr.policy.reload_text_encoders("cpu")
    if tr.ema is not None:
        tr.ema.swap()
    try:
        return export_pipeline(tr.policy.pipeline, tr.policy.transformer,
                               tr.run_dir / "final_model", defaults=tr.policy.defaults)
    finally:
        if tr.ema is not None:
            tr.ema.swap()


def main(argv: list[str] | None = None) -> Path:
    yaml_path, overrides, resume = parse_args(argv)
    if resume:
        run_dir = Path(resume)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume {resume}: no config.yaml there; give the run directory")
        saved = load_yaml(run_dir / "config.yaml")
        cfg = build_config(None, {**saved, **overrides})
        return run(cfg, run_dir=run_dir, resume=True)
    # No --config: the dataclass defaults, which configs/default.yaml spells out.
    return run(build_config(yaml_path, overrides))


if __name__ == "__main__":
    run_cli(main, "chunk_grpo.train")
