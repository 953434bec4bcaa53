"""Chunk-GRPO training: ``python -m chunk_grpo.train`` (see ``--help``).

With no arguments it fine-tunes the embedded tiny FLUX on the default reward on the CPU;
``--config configs/flux_dev_hpsv3.yaml`` under torchrun trains FLUX.1-dev with the paper's settings.

One iteration, in the order it runs (`train_iteration`):
  1. sample prompts (rank-aware)
  2. group rollouts with the SDE sampler, storing every latent x_t and log-prob
  3. decode and score the images (each rollout batch while the next is sampled; a mix of
     rewards gives each reward's scores and their weighted total)
  4. group-relative advantages (of the total, or of each reward, then weighted and summed)
  5. choose the chunks to train (all, or a fraction drawn uniformly / by dynamics weight)
  6. gradients micro-batch by micro-batch (one transformer call and one loss call over the
     micro-batch's chunks), and at every accumulation boundary the optimizer step: gradient
     sync, clipping, the step, the schedule and the EMA
  7. log; every N iterations evaluate on held-out prompts and checkpoint.
A guard reward (`chunk_grpo.rewards.guard`, `eval.guard_reward`) is scored beside the trained one on
step 3's images and at every evaluation; it trains nothing, and it stops the run early when it
falls beyond `eval.guard_stop`.
With ``algorithm: g2rpo`` step 2 branches each prompt's ODE trajectory at one step and finishes
the branches at several strides (`chunk_grpo.algorithm.branching`), step 4 sums the finishes'
advantages, and step 5 trains that one step. The two are samplers of one interface
(`chunk_grpo.algorithm.samplers`), chosen once when the trainer is built; `collect_batch` calls the
interface only. The run is built by `chunk_grpo.train.setup` and evaluated by
`chunk_grpo.train.run_eval`. Under torchrun the transformer is sharded with FSDP2 or wrapped in DDP
(`parallelism`), the DDP's gradients sync only at accumulation boundaries, and every rank writes
its shards of the checkpoints (`chunk_grpo.train.run_checkpoint`). Under FSDP the transformer
loads straight into its shards and gradients are reduce-scattered every micro-batch
(`chunk_grpo.models.sharded_load`, `chunk_grpo.runtime.parallelize`). The hybrid-evaluation base
comes from the policy's own weights (`chunk_grpo.models.hybrid_base`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from chunk_grpo.algorithm.advantages import multi_granularity_advantages, per_reward_advantages
from chunk_grpo.algorithm.chunking import ChunkLayout
from chunk_grpo.algorithm.policy_update import (
    TrainUnit,
    UpdateRecord,
    accumulate_gradients,
    plan_units,
)
from chunk_grpo.algorithm.rollout import Rollout
from chunk_grpo.config.errors import (
    ConfigError,
    NothingTrained,
    RunInterrupted,
    TrainingDiverged,
    interruption,
)
from chunk_grpo.config.parsing import config_from_saved, save_config
from chunk_grpo.config.schema import TrainConfig
from chunk_grpo.models.prompt_cache import setup_text_encoders
from chunk_grpo.plan.bounds import check_train_memory
from chunk_grpo.plan.memory import check_plan
from chunk_grpo.rewards.outputs import RewardError
from chunk_grpo.rewards.scoring import RolloutScorer, constant_within_groups
from chunk_grpo.runtime import distributed as D
from chunk_grpo.runtime.parallelize import (
    any_rank,
    check_parallelism,
    clip_grad_norm,
    sync_gradients,
)
from chunk_grpo.runtime.precision import resolve_mixed_precision
from chunk_grpo.train.checkpoint import latest_checkpoint
from chunk_grpo.train.export import export_targets
from chunk_grpo.train.metrics import reward_captions
from chunk_grpo.train.phase_memory import PhaseMemory, active_phase, current
from chunk_grpo.train.progress import BAR_FORMAT, progress_postfix, training_progress
from chunk_grpo.train.run_checkpoint import (
    NonFiniteWeights,
    apply_resume_changes,
    check_fixed_keys,
    config_for_world,
    find_run_checkpoint,
    restore_run,
    save_run_checkpoint,
)
from chunk_grpo.train.run_eval import evaluate, finish_run, finished_complete
from chunk_grpo.train.run_lock import RunLock
from chunk_grpo.train.setup import (
    PolicySetup,
    PromptSets,
    Trainer,
    build_policy,
    build_trainer,
    check_prompt_sets,
    check_reward_name,
    read_prompt_sets,
    resolve_guard,
    resolve_reward,
)

# ----------------------------------------------------------------------------- one iteration

class _PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        with active_phase(name):  # its peak memory too, when the run records phases
            yield
        self.seconds[f"time/{name}"] = time.perf_counter() - start


@dataclass
class Batch:
    """An iteration's scored rollouts, ready for the update (steps 1-5)."""

    rollout: Rollout
    advantages: torch.Tensor  # [B] on the trainer's device
    units: list[TrainUnit]
    metrics: dict = field(default_factory=dict)
    finite: bool = True  # False: a reward was NaN/Inf and the iteration is skipped


def collect_batch(tr: Trainer, step: int, timer: _PhaseTimer | None = None, *,
                  split_chunks: bool = False) -> Batch:
    """Steps 1-5 of an iteration: prompts, rollouts, rewards, advantages and the training units
    (``split_chunks``: one unit per chunk and micro-batch, for per-chunk gradients)."""
    cfg, info = tr.cfg, tr.info
    sampling, loss, seed = cfg.sampling, cfg.loss, cfg.run.seed
    sampler = tr.sampler
    timer = timer or _PhaseTimer()

    # 1. prompts for this rank
    prompts = D.sample_prompts(tr.train_prompts, sampling.prompts_per_step, seed=seed, step=step,
                               info=info)

    # 5 (drawn first). The chunks trained, from (seed, step) alone: every rank trains the same
    # chunks, so their work is equal and no rank waits for another at the gradient sync.
    # G2RPO branches at the step it trains.
    gen = D.step_generator(seed, step, 0, "chunks")
    weights = tr.chunk_weights if cfg.chunks.weighted else None
    chunks = sampler.choose_chunks(tr.layout, cfg.chunks.fraction, weights, gen)

    # 2. rollouts with latents and log-probs stored (`chunk_grpo.algorithm.samplers`). Noise keyed
    # by global image index: this rank's rows start at rank * P * G.
    with RolloutScorer(tr.reward_fn, overlap=cfg.reward.overlap,
                       timeout=cfg.reward.timeout) as scorer:
        with timer("rollout"):  # 3. may begin here: batches scored while the next is sampled
            sampled = sampler.sample(tr.policy, prompts, chunks, step=step,
                                     row_offset=info.rank * len(prompts) * sampling.group_size,
                                     scorer=scorer)
        rollout = sampled.rollout

        # 3. score the decoded images (every finish): each reward's scores, and the total
        row_prompts = [prompts[i] for i in rollout.prompt_index.tolist()]
        with timer("reward"):
            components = sampler.score(sampled, scorer, row_prompts)
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
    for stride, r in zip(sampler.granularities[1:], gathered[1:], strict=True):
        metrics[f"reward_mean_stride{stride}"] = float(r.mean())
    metrics["time/reward_scoring"] = scorer.busy_seconds
    if tr.guard is not None and tr.guard.on_rollouts:  # beside the reward; trains nothing
        with timer("guard"):
            guard_scores = tr.guard.score(rollout.images, row_prompts)
        metrics.update(tr.guard.metrics({k: D.all_gather_cat(v.to(info.device), info).cpu()
                                         for k, v in guard_scores.items()}))
    if not all(bool(torch.isfinite(r).all()) for r in
               [*gathered, *(v for c in gathered_parts for v in c.values())]):
        metrics.update(skipped=1, nonfinite="reward")
        return Batch(rollout, torch.empty(0), [], metrics, finite=False)
    if info.is_main:
        _warn_if_constant(tr, gathered_parts[0], step)
    if cfg.run.image_grid_every and step % cfg.run.image_grid_every == 0 and info.is_main:
        tr.logger.image_grid(step, "rollout", rollout.images,
                             reward_captions(row_prompts, scores[0]), columns=sampling.group_size)

    # 4. group-relative advantages (G2RPO: summed over the finishes)
    if cfg.reward.mix_advantage == "per_reward":
        terms = [(tr.reward_fn.weights[label], r, pool[label])
                 for c, pool in zip(components, gathered_parts, strict=True)
                 for label, r in c.items()]
        advantages = per_reward_advantages(terms, sampling.group_size, norm=loss.adv_norm,
                                           eps=loss.adv_eps, clip_max=loss.adv_clip_max)
    else:
        advantages = multi_granularity_advantages(scores, sampling.group_size, norm=loss.adv_norm,
                                                  eps=loss.adv_eps, clip_max=loss.adv_clip_max,
                                                  all_rewards=gathered)
    metrics.update(adv_mean=float(advantages.mean()), adv_std=float(advantages.std()),
                   adv_abs_max=float(advantages.abs().max()))

    # 5. the micro-batches that train the chosen chunks
    units = plan_units(chunks, rollout.latents.shape[0], cfg.optim.micro_batch_size, gen,
                       split_chunks=split_chunks)
    metrics["chunks_trained"] = ",".join(str(j) for j in chunks)
    return Batch(rollout, advantages.to(info.device), units, metrics)


def optimizer_step(tr: Trainer, nonfinite: torch.Tensor | bool, record: UpdateRecord) -> None:
    """The step at an accumulation boundary (the gradients are already averaged across ranks
    by DDP or FSDP): clip their global norm, step the optimizer, the schedule and the EMA, or
    skip the step when a loss or the gradient is NaN/Inf on any rank (all ranks alike), and
    zero the gradients. The skip decision is the step's one host read: the loss flag and the
    norm's finiteness, combined on the device and across ranks in one all-reduce."""
    norm = clip_grad_norm(tr.params, tr.cfg.optim.max_grad_norm)
    bad = torch.as_tensor(nonfinite, device=tr.info.device) | ~torch.isfinite(
        norm.to(tr.info.device))
    if any_rank(bad, tr.info.device):
        record.skipped_steps += 1
    else:
        tr.optimizer.step()
        tr.scheduler.step()
        if tr.ema is not None:
            tr.ema.update()
        record.optimizer_steps += 1
        record.note_grad_norm(norm)
    tr.optimizer.zero_grad(set_to_none=True)


def train_iteration(tr: Trainer, step: int) -> tuple[dict, bool]:
    """One Chunk-GRPO (or G2RPO) iteration; returns (metrics, finite) -- finite False = step
    skipped."""
    timer = _PhaseTimer()
    batch = collect_batch(tr, step, timer)  # steps 1-5
    metrics = batch.metrics
    if not batch.finite:
        metrics.update(timer.seconds)
        return metrics, False

    # 6. gradients unit by unit; the optimizer steps at every accumulation boundary
    record = UpdateRecord()
    with timer("train"):
        tr.optimizer.zero_grad(set_to_none=True)
        for nonfinite in accumulate_gradients(
                tr.policy, batch.rollout, batch.rollout.prompt_embeds, batch.advantages,
                batch.units, [tr.layout.steps(j) for j in range(tr.layout.num_chunks)],
                tr.loss_settings, record,
                grad_sync=lambda boundary: sync_gradients(tr.module, boundary),
                reference=tr.reference):
            optimizer_step(tr, nonfinite, record)

    # 7. metrics of the update
    metrics.update(
        loss=_mean(record.losses), grad_norm=_mean(record.grad_norms),
        optimizer_steps=record.optimizer_steps, skipped=record.skipped_steps,
        rollout_logp_gap=record.rollout_logp_gap)
    for j, stats in sorted(record.chunk_stats.items()):
        for name, values in stats.items():
            metrics[f"chunk{j}/{name}"] = _mean(values)
    for name in ("approx_kl", "clip_frac", "ratio_mean", "ref_kl"):
        values = [v for s in record.chunk_stats.values() for v in s.get(name, [])]
        if values:
            metrics[name] = _mean(values)
    metrics.update(timer.seconds)
    return metrics, record.skipped_steps == 0


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def _warn_if_constant(tr: Trainer, rewards: dict[str, torch.Tensor], step: int) -> None:
    """Warn once per reward that scores every image of each group alike: its advantages are all
    zero, so it gives no learning signal."""
    for c in tr.reward_fn.components:
        if c.label in tr.warned_constant or not constant_within_groups(rewards[c.label],
                                                                       tr.cfg.sampling.group_size):
            continue
        tr.warned_constant.add(c.label)
        tqdm.write(f"[chunk-grpo] warning: reward {c.name!r} gave the same score to every image "
                   f"of each group at step {step + 1}: its advantages are all 0, so it gives no "
                   f"learning signal. Check that it depends on the images (python -m "
                   f"chunk_grpo.gradient_snr --reward.name {c.name})")


# ----------------------------------------------------------------------------- the run

def _default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def run(cfg: TrainConfig, *, run_dir: str | Path | None = None, resume: bool = False,
        on_step_end=None, trust_checkpoint: bool = False) -> Path:
    """Train; returns the run directory (with the model exported at the end, `run.export`).

    ``on_step_end(step, metrics)`` is called after every iteration (e.g. to stop early).
    ``trust_checkpoint``: resume from a checkpoint without a manifest
    (`chunk_grpo.train.checkpoint`). Resuming a finished run changes nothing unless max_steps (or
    max_minutes) was changed.
    """
    if cfg.run.max_steps == 0 and not resume:
        raise ConfigError("run.max_steps is 0: a run with no iteration trains nothing; give "
                          "--run.max_steps N (N >= 1)")
    # Before the run directory: a bad prompt file, a misspelt or failing reward or a bad model
    # path leaves nothing behind.
    prompt_sets = read_prompt_sets(cfg)
    check_reward_name(cfg)
    info = D.init_for_config(cfg)
    check_parallelism(cfg.parallel.mode, info.world_size, cfg.parallel.cpu_offload)
    if info.device.type == "cuda":  # the memory plan, before a weight is loaded
        check_plan(cfg, info.world_size, torch.cuda.get_device_properties(info.device).total_memory)
    else:  # the plan's arithmetic against the host's memory (milliseconds)
        check_train_memory(cfg, info.world_size)
    with PhaseMemory(info.device).activate() as memory:  # each phase's peak, for phases.json
        return _run(cfg, info, prompt_sets, memory, run_dir, resume, on_step_end,
                    trust_checkpoint)


def _run(cfg: TrainConfig, info: D.DistInfo, prompt_sets: PromptSets, memory: PhaseMemory,
         run_dir: str | Path | None, resume: bool, on_step_end,
         trust_checkpoint: bool = False) -> Path:
    with memory.phase("load"):
        # The policy first (under FSDP straight into its shards), then the reward beside it.
        setup = build_policy(cfg, info)
        reward_fn = resolve_reward(cfg, info.device)
        guard = resolve_guard(cfg, info.device)
    check_prompt_sets(prompt_sets, setup.policy, reward_fn, guard)
    # text_encoders: cache -> every prompt embedded once (on disk), the encoders freed
    with memory.phase("prompt_cache"):
        setup_text_encoders(setup.policy, cfg.model.text_encoders,
                            [p for _, s in prompt_sets.items() for p in s.prompts],
                            cfg.model.prompt_cache_dir, info, progress=cfg.run.progress)
    run_dir = Path(run_dir or cfg.run.output_dir or _default_run_dir())
    lock = RunLock(run_dir)
    if info.is_main:
        if not resume and (run_dir / "checkpoints").exists():
            raise ConfigError(f"{run_dir} already holds a run; pass --resume {run_dir} to "
                              "continue it or choose another run.output_dir")
        _make_run_dir(run_dir)
        lock.acquire()  # a second run on this directory stops here, before writing anything
    try:
        started = _start_or_resume(cfg, run_dir, info, resume, prompt_sets, reward_fn, setup,
                                   trust_checkpoint, guard)
        if started is None:  # a finished run, nothing asked of it: nothing changes
            return run_dir
        tr, start, bad_streak = started
        if info.is_main:
            budget = (f" or {cfg.run.max_minutes:g} min of training, whichever comes first"
                      if cfg.run.max_minutes > 0 else "")
            print(f"[chunk-grpo] run dir {run_dir}; chunks {list(tr.layout.sizes)}; "
                  f"steps {start}..{cfg.run.max_steps}{budget}", flush=True)
            if tr.guard is not None:
                where = "rollouts and evaluations" if tr.guard.on_rollouts else "evaluations"
                stop = (f"; stops if it falls by more than {cfg.eval.guard_stop:g}"
                        if cfg.eval.guard_stop > 0 else "")
                print(f"[chunk-grpo] guard {tr.guard.spec} scored on the {where}{stop}",
                      flush=True)
            precision = resolve_mixed_precision(cfg.model.mixed_precision, info.device)
            print(f"[chunk-grpo] mixed precision: {precision.mode} ({precision.reason})",
                  flush=True)
        _train_loop(tr, start, bad_streak, on_step_end)
        tr.logger.close()
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (`chunk_grpo.cli`)
        last = latest_checkpoint(run_dir)
        where = (f"resume from {last} with --resume {run_dir}" if last is not None else
                 "no checkpoint was written yet")
        what, status = interruption(err)
        raise RunInterrupted(f"interrupted ({what}); {where}", status) from None
    finally:
        lock.release()
    return run_dir


def _start_or_resume(cfg: TrainConfig, run_dir: Path, info: D.DistInfo, resume: bool,
                     prompt_sets: PromptSets, reward_fn, setup: PolicySetup,
                     trust_checkpoint: bool = False, guard=None
                     ) -> tuple[Trainer, int, int] | None:
    """The trainer, fresh or restored from the newest intact checkpoint (saved at any world
    size); (trainer, first step, bad streak), or None for a finished run that is
    left as it is."""
    saved = None
    if resume:
        saved = find_run_checkpoint(run_dir, trust=trust_checkpoint)
        check_fixed_keys(cfg, saved)
        if _finished_unchanged(cfg, saved, run_dir, info):
            return None
        cfg, change = config_for_world(cfg, saved, info.world_size)
        if change and info.is_main:
            print(change, flush=True)
    elif info.is_main:
        if (run_dir / "checkpoints").exists():  # another run got here first
            raise ConfigError(f"{run_dir} already holds a run; pass --resume {run_dir} to "
                              "continue it or choose another run.output_dir")
        save_config(cfg, run_dir / "config.yaml")
    D.barrier(info)
    tr = build_trainer(cfg, run_dir, info, prompt_sets=prompt_sets,
                       layout=ChunkLayout(saved.layout) if saved else None,
                       chunk_weights=saved.chunk_weights if saved else None,
                       reward_fn=reward_fn, setup=setup, guard=guard)
    if saved is None:
        return tr, 0, 0
    restore_run(tr, saved)
    change = apply_resume_changes(tr, saved)
    if change and info.is_main:
        print(change, flush=True)
    tr.logger.truncate_after(saved.step)
    if info.is_main:
        save_config(cfg, run_dir / "config.yaml")
    return tr, saved.step, saved.bad_streak


def _finished_unchanged(cfg: TrainConfig, saved, run_dir: Path, info: D.DistInfo) -> bool:
    """Whether a resume leaves the run as it is: its checkpoint is the step it finished at
    (summary and final model written) and neither max_steps was raised above it nor max_minutes
    changed (then one line says so). A max_steps below the checkpoint's step is a ConfigError:
    nothing is changed either."""
    step, asked = saved.step, cfg.run.max_steps
    finished = finished_complete(run_dir, step, export_targets(run_dir, cfg.run.export,
                                                               cfg.model.lora_rank > 0))
    if asked < step:
        raise ConfigError(f"{run_dir} is at step {step}, beyond run.max_steps {asked}: nothing "
                          f"to train and nothing changed; give --run.max_steps above {step} to "
                          "train further")
    before = config_from_saved(saved.state["config"]).run
    more = asked > step and (asked > before.max_steps or cfg.run.max_minutes != before.max_minutes)
    if not finished or more:
        return False
    if info.is_main:
        print(f"[chunk-grpo] {run_dir} finished at step {step} (summary.txt and the exports "
              f"kept); nothing changed: give --run.max_steps above {step} to train "
              "further",
              flush=True)
    return True


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
                          f"run.output_dir") from None


def _train_loop(tr: Trainer, start: int, bad_streak: int, on_step_end) -> None:
    """Iterations ``start`` .. max_steps: train, evaluate, log, checkpoint; export at the end."""
    cfg, info, run_dir = tr.cfg, tr.info, tr.run_dir
    rc = cfg.run
    t_start = time.time()
    # The bar counts to the step the run is expected to stop at: max_steps, or sooner when the
    # time budget binds first (`chunk_grpo.train.progress`), with the training time left as its ETA.
    progress = training_progress(start=start, step=start, max_steps=rc.max_steps,
                                 max_minutes=rc.max_minutes, elapsed=0.0)
    bar = tqdm(total=progress.total, initial=start, desc="chunk-grpo", bar_format=BAR_FORMAT,
               disable=not (rc.progress and info.is_main))
    bar.set_postfix_str(progress_postfix(progress, max_steps=rc.max_steps,
                                         max_minutes=rc.max_minutes))
    last = start
    for step in range(start, rc.max_steps):
        try:
            metrics, finite = train_iteration(tr, step)
            last = step + 1
            _count_steps(tr.counts, metrics)
            _count_chunks(tr.chunk_counts, metrics)
            bad_streak = 0 if finite else bad_streak + 1
            out_of_time = rc.max_minutes > 0 and time.time() - t_start > 60 * rc.max_minutes
            done = step + 1 == rc.max_steps or out_of_time
            if out_of_time and step + 1 < rc.max_steps:
                tr.stop_reason = (f"the time budget ran out (run.max_minutes {rc.max_minutes:g}) "
                                  f"after {step + 1} of run.max_steps {rc.max_steps}")
            if (cfg.eval.every and (step + 1) % cfg.eval.every == 0) or done:
                t = time.perf_counter()
                with active_phase("eval"):
                    metrics.update(evaluate(tr, step + 1, final=done))
                    if not done and tr.stop_reason is not None:  # the guard fell: stop here
                        done = True
                        if info.is_main:
                            tqdm.write(f"[chunk-grpo] stopping early: {tr.stop_reason}; the "
                                       "final evaluation, summary and export follow")
                        metrics.update(evaluate(tr, step + 1, final=True))
                metrics["time/eval"] = time.perf_counter() - t
        except RewardError as err:  # one line on the command line, naming what is kept
            raise type(err)(f"{err}; the run stopped at step {step + 1}, "
                            f"{_kept_checkpoint(run_dir)}") from err
        if (step + 1) % rc.log_every == 0 or done or not finite:
            tr.logger.log(step + 1, {**metrics, **(current().metrics() if current() else {})})
        progress = training_progress(start=start, step=step + 1, max_steps=rc.max_steps,
                                     max_minutes=rc.max_minutes, elapsed=time.time() - t_start)
        if done:  # whatever ended it: the bar full, nothing left
            progress = dataclasses.replace(progress, total=step + 1, eta_seconds=0.0)
        bar.total = progress.total
        bar.set_postfix_str(progress_postfix(progress, max_steps=rc.max_steps,
                                             max_minutes=rc.max_minutes,
                                             reward=metrics["reward_mean"]), refresh=False)
        bar.update(1)
        if bad_streak >= rc.max_bad_steps:
            raise TrainingDiverged(
                f"{bad_streak} iterations in a row had NaN/Inf rewards, losses or gradients "
                f"(last at step {step + 1}); stopping, {_kept_checkpoint(run_dir)}; lower lr "
                f"or clip ranges, or check the reward.")
        if finite and ((rc.checkpoint_every and (step + 1) % rc.checkpoint_every == 0)
                       or done):
            _checkpoint(tr, step + 1, bad_streak)
        if on_step_end is not None:
            on_step_end(step + 1, metrics)
        if done:
            break
    bar.close()
    _check_trained(tr, last)
    # the summary, then the exports (every rank: a sharded model is gathered for rank 0)
    text = finish_run(tr, last, last - start, (time.time() - t_start) / 60)
    save_phase_memory(tr)
    if info.is_main and rc.progress:
        print(text, flush=True)


def _count_steps(counts: dict[str, int], metrics: dict) -> None:
    """Add an iteration's optimizer steps and skips to the run's counts."""
    if metrics.get("nonfinite") == "reward":
        counts["reward_skipped"] += 1
    else:
        counts["optimizer_steps"] += int(metrics["optimizer_steps"])
        counts["skipped_steps"] += int(metrics["skipped"])


def _count_chunks(counts: list[int], metrics: dict) -> None:
    """Add the chunks an iteration trained (none when its rewards were NaN/Inf) to the run's
    count per chunk."""
    trained = metrics.get("chunks_trained")
    if trained:
        for j in trained.split(","):
            counts[int(j)] += 1


def _check_trained(tr: Trainer, step: int) -> None:
    """A run that took no optimizer step at all is NothingTrained, with the cause: its final
    model would be the base (nothing is exported and no summary written)."""
    counts = tr.counts
    if counts["optimizer_steps"] > 0:
        return
    causes = []
    if counts["reward_skipped"]:
        causes.append(f"the rewards were NaN/Inf in {counts['reward_skipped']} iteration(s) "
                      "(check the reward)")
    if counts["skipped_steps"]:
        causes.append(f"the loss or gradient were NaN/Inf at all {counts['skipped_steps']} "
                      "optimizer step(s) (lower lr, eta or the clip range)")
    raise NothingTrained(f"no optimizer step in {step} iteration(s): "
                         f"{'; '.join(causes) or 'nothing was trained'}; final_model is not "
                         f"exported (it would be the base model), {_kept_checkpoint(tr.run_dir)}")


def _checkpoint(tr: Trainer, step: int, bad_streak: int) -> None:
    """Checkpoint ``step`` on every rank; NaN/Inf weights are never saved: the run stops and the
    last checkpoint on disk stays the one to resume."""
    try:
        with active_phase("checkpoint"):
            save_run_checkpoint(tr, step, bad_streak)
    except NonFiniteWeights as err:
        last = latest_checkpoint(tr.run_dir)
        kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
        raise TrainingDiverged(
            f"{err} hold NaN/Inf at step {step}; they are not saved and {kept}. Lower optim.lr "
            f"or optim.max_grad_norm and resume or restart.") from None
    D.barrier(tr.info)


def save_phase_memory(tr: Trainer) -> None:
    """phases.json in the run directory: every rank's peak memory and seconds per phase
    (`chunk_grpo.train.phase_memory`), gathered on rank 0."""
    memory = current()
    if memory is None:
        return
    report = dict(memory.report(), rank=tr.info.rank)
    reports = [report]
    if tr.info.world_size > 1:
        reports = [None] * tr.info.world_size
        torch.distributed.all_gather_object(reports, report)
    if tr.info.is_main:
        (tr.run_dir / "phases.json").write_text(json.dumps({"ranks": reports}, indent=1) + "\n")


def _kept_checkpoint(run_dir: Path) -> str:
    """Where the run can be resumed from, for the messages of a run that stops early."""
    last = latest_checkpoint(run_dir)
    if last is None:
        return "and no checkpoint was written yet (nothing to resume)"
    return f"its last checkpoint {last} is intact (resume with --resume {run_dir})"
