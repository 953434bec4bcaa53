"""What a training run reports about its policy: the periodic and final held-out evaluation
(with hybrid inference and the paired gain over the base), the closing summary, and the
exported model (in the formats of `run.export`).

A run finishes in two stages, each recorded in RUN/finished.json once done (``{"step": N,
"summary": true, "final_model": true}``; "final_model": every export written): the summary (the
before/after comparison) first, then the exports, so a kill at any point loses neither; a resume
redoes what is missing (`finish_run`), including an export format added with the resume.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from chunk_grpo.evaluate.evaluation import EvalResult, evaluate_policy
from chunk_grpo.evaluate.stats import mean_ci95
from chunk_grpo.rewards.guard import stop_reason
from chunk_grpo.runtime import distributed as D
from chunk_grpo.runtime.parallelize import is_sharded
from chunk_grpo.runtime.weights_dtype import resolve_weights_dtype
from chunk_grpo.train.checkpoint import DiskFullError, latest_checkpoint
from chunk_grpo.train.export import export_full_model, export_targets, write_exports
from chunk_grpo.train.metrics import reward_captions
from chunk_grpo.train.phase_memory import active_phase
from chunk_grpo.train.setup import Trainer
from chunk_grpo.train.summary import (
    ChunkReport,
    Comparison,
    before_after_pairs,
    paired_gain,
    save_summary,
    summary_numbers,
    summary_text,
)

GRID_IMAGES = 32  # evaluation images kept for grids (the rest are dropped after scoring)


def evaluate(tr: Trainer, step: int, final: bool = False) -> dict:
    """Held-out reward with 95% CI (ODE sampling with the model's default steps and shift, EMA
    weights if any), and hybrid inference; with a guard (`chunk_grpo.rewards.guard`; the shapes
    checks on shapes prompts by default) its score of the same images and its per-attribute
    accuracies too. With the base model at hand, also the paired gains over it (the reward's and the
    guard's): the same images (prompts and initial noise) sampled by the base, once per image
    count. ``final``: `final_eval_images` images, kept in ``tr.final_evals`` for the summary.
    A periodic evaluation whose guard fell beyond `eval.guard_stop` sets ``tr.stop_reason``."""
    cfg, out = tr.cfg, {}
    count = eval_image_count(cfg.eval.final_images if final else cfg.eval.images,
                             tr.info.world_size)
    prompts = [tr.eval_prompts[i % len(tr.eval_prompts)] for i in range(count)]
    guard = tr.guard
    settings = dict(reward=tr.reward_fn, guard=guard.reward if guard else None,
                    seed=cfg.run.seed + 1, cfg_scale=tr.cfg_scale,
                    batch_size=cfg.sampling.batch_size)
    if tr.base_policy is not None and count not in tr.base_evals:
        base = evaluate_split(tr.info, tr.base_policy, prompts, **settings)
        tr.base_evals[count] = dataclasses.replace(base, images=base.images[:GRID_IMAGES])
    base_eval = tr.base_evals.get(count)
    if tr.ema is not None:
        tr.ema.swap()
    try:
        runs = [("eval", None, 0)]
        if cfg.eval.hybrid_steps and tr.base_policy is not None:
            runs.append(("eval_hybrid", tr.base_policy, cfg.eval.hybrid_steps))
        for name, base, k in runs:
            # The model's own sampling defaults, as `python -m chunk_grpo.evaluate` uses them.
            res = evaluate_split(tr.info, tr.policy, prompts, hybrid_base=base,
                                 hybrid_steps=k, **settings)
            out[f"{name}/reward_mean"] = res.reward_mean
            out[f"{name}/reward_ci95"] = res.reward_ci95
            out.update({f"{name}/{key}": value for key, value in res.attributes.items()})
            if base_eval is not None:
                gain, gain_ci, _ = paired_gain(base_eval.rewards, res.rewards)
                out[f"{name}/gain_vs_base"], out[f"{name}/gain_ci95"] = gain, gain_ci
            if guard is not None:
                out.update(_guard_metrics(tr, name, res, base_eval, step, final))
            if final:
                tr.final_evals[name] = dataclasses.replace(res, images=res.images[:GRID_IMAGES])
            tr.logger.image_grid(step, name, res.images[:GRID_IMAGES],
                                 reward_captions(res.prompts[:GRID_IMAGES],
                                                 res.rewards[:GRID_IMAGES]))
    finally:
        if tr.ema is not None:
            tr.ema.swap()
    return out


def _guard_metrics(tr: Trainer, name: str, res: EvalResult, base: EvalResult | None,
                   step: int, final: bool) -> dict:
    """The guard's numbers of one evaluation (``eval/guard/<name>_mean``, ``_ci95``, and
    against the base ``_gain_vs_base``, ``_gain_ci95``); at a periodic evaluation of the
    trained model alone, the early-stop rule (`chunk_grpo.rewards.guard.stop_reason`)."""
    key = f"{name}/guard/{tr.guard.name}"
    out = dict(zip((f"{key}_mean", f"{key}_ci95"), mean_ci95(res.guard_scores), strict=True))
    if base is None:
        return out
    gain, gain_ci, _ = paired_gain(base.guard_scores, res.guard_scores)
    out[f"{key}_gain_vs_base"], out[f"{key}_gain_ci95"] = gain, gain_ci
    if name == "eval" and not final:
        reason = stop_reason(tr.guard.name, gain, gain_ci, res.n, tr.cfg.eval.guard_stop, step)
        tr.stop_reason = reason or tr.stop_reason
    return out


def eval_image_count(images: int, world_size: int) -> int:
    """Images an evaluation samples: ``images``, rounded up to a multiple of the world size so
    that every rank samples as many (under FSDP each forward is a collective of all ranks)."""
    return math.ceil(images / world_size) * world_size


def evaluate_split(info: D.DistInfo, policy, prompts: list[str], **settings) -> EvalResult:
    """`evaluate_policy` split across the ranks: rank r samples and scores its contiguous slice
    of ``prompts`` (the same count on every rank) with the noise of its global image indices,
    and the slices are gathered, so N ranks give the result one process gives. Each rank keeps
    its own share of the first `GRID_IMAGES` images for the grids."""
    if info.world_size == 1:
        return evaluate_policy(policy, prompts, **settings)
    per = len(prompts) // info.world_size  # `eval_image_count` made it a multiple
    start = info.rank * per
    part = evaluate_policy(policy, prompts[start:start + per], index_offset=start, **settings)
    rewards = D.all_gather_cat(part.rewards.to(info.device), info).cpu()
    guard = None
    if part.guard_scores is not None:
        guard = D.all_gather_cat(part.guard_scores.to(info.device), info).cpu()
    shares = [None] * info.world_size
    dist.all_gather_object(shares, (part.attributes, part.sampling_seconds,
                                    part.images[:max(0, GRID_IMAGES - start)]))
    attributes = {key: float(torch.tensor([a[key] for a, _, _ in shares]).nanmean())
                  for key in part.attributes}  # equal counts: the mean of the ranks' means
    mean, ci = mean_ci95(rewards)
    return EvalResult(mean, ci, len(prompts), rewards, list(prompts),
                      torch.cat([images for _, _, images in shares]), attributes,
                      max(seconds for _, seconds, _ in shares), part.images_per_prompt, guard)


FINISHED = "finished.json"


def read_finished(run_dir: Path) -> dict:
    """RUN/finished.json: the step the run finished at and which stages are done ({} if none)."""
    try:
        record = json.loads((run_dir / FINISHED).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def finished_complete(run_dir: Path, step: int, targets: dict[str, Path]) -> bool:
    """Whether the run finished at ``step`` with its summary and the exports ``targets``
    ({format: directory}, `export_targets`) all written."""
    record = read_finished(run_dir)
    return (record.get("step") == step and record.get("summary") is True
            and record.get("final_model") is True and _exported(targets))


def _exported(targets: dict[str, Path]) -> bool:
    return all(directory.is_dir() for directory in targets.values())


def _record_finished(run_dir: Path, record: dict) -> None:
    tmp = run_dir / (FINISHED + ".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, run_dir / FINISHED)


def finish_run(tr: Trainer, step: int, iterations: int, minutes: float) -> str | None:
    """The end of a run at ``step`` (every rank calls this): the summary, then the exports,
    each recorded in RUN/finished.json when done; what a killed finish had done is kept and the
    rest redone (the final evaluation too, if the summary was not written). Returns the
    summary's text on rank 0."""
    run_dir, is_main = tr.run_dir, tr.info.is_main
    targets = export_targets(run_dir, tr.cfg.run.export, tr.cfg.model.lora_rank > 0)
    done = read_finished(run_dir)
    same = done.get("step") == step
    record = {"step": step, "summary": same and done.get("summary") is True,
              "final_model": same and done.get("final_model") is True}
    text = None
    if not record["summary"]:
        if "eval" not in tr.final_evals:  # a resume of a run killed before its summary
            with active_phase("eval"):
                evaluate(tr, step, final=True)
        if is_main:
            text = finish_summary(tr, step, iterations, minutes, targets, updates=tr.counts)
            record["summary"] = True
            _record_finished(run_dir, record)
    elif is_main:
        text = (run_dir / "summary.txt").read_text()
    if not (record["final_model"] and _exported(targets)):
        try:
            with active_phase("export"):
                export_final(tr)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            raise DiskFullError(errno.ENOSPC, f"no space left on device to export "
                                f"{', '.join(map(str, targets.values()))}; the summary and the "
                                f"last checkpoint {latest_checkpoint(run_dir)} are kept: free "
                                f"some space and run --resume {run_dir} to export it") from None
        if is_main:
            record["final_model"] = True
            _record_finished(run_dir, record)
    D.barrier(tr.info)
    return text


def finish_summary(tr: Trainer, step: int, iterations: int, minutes: float,
                   exports: dict[str, Path], updates: dict[str, int] | None = None) -> str:
    """The run's closing screen (before -> after on the final evaluation; ``exports``: where
    the model is written; ``updates``: the run's step counts), saved in the run directory with
    a before/after grid, and sent to the logging backends."""
    base = tr.base_evals.get(eval_image_count(tr.cfg.eval.final_images, tr.info.world_size))
    guard = tr.guard.name if tr.guard is not None else None
    comparisons = [] if base is None else [
        Comparison.of(name, base, res, guard=guard) for name, res in tr.final_evals.items()]
    chunks = chunk_report(tr, step)
    text = summary_text(run_dir=tr.run_dir, reward=tr.cfg.reward.name, comparisons=comparisons,
                        iterations=iterations, minutes=minutes,
                        hybrid_steps=tr.cfg.eval.hybrid_steps, model_dir=exports.get("merged"),
                        exports=exports, updates=updates, chunks=chunks,
                        stopped=tr.stop_reason)
    save_summary(tr.run_dir, text, comparisons, chunks, tr.stop_reason)
    if base is not None and "eval" in tr.final_evals:
        images, captions = before_after_pairs(base, tr.final_evals["eval"])
        tr.logger.image_grid(step, "before_after", images, captions,
                             filename="before_after.png")
    tr.logger.summary(text, summary_numbers(comparisons, chunks))
    return text


def chunk_report(tr: Trainer, step: int) -> ChunkReport:
    """Which chunks the run trained, how they were drawn and how often (over all ``step``
    iterations, resumes included: the counts are kept in the checkpoints)."""
    cfg, layout = tr.cfg, tr.layout
    if cfg.sampling.algorithm == "g2rpo":  # one branch step per iteration
        per_iteration = 1
    else:
        per_iteration = max(1, min(layout.num_chunks,
                                   round(cfg.chunks.fraction * layout.num_chunks)))
    return ChunkReport(sizes=list(layout.sizes), trained=list(tr.chunk_counts), iterations=step,
                       per_iteration=per_iteration,
                       weighted=cfg.chunks.weighted,
                       sampling_steps=cfg.sampling.steps)


def export_final(tr: Trainer) -> dict[str, Path]:
    """The trained model in the run's export formats (`run.export`, `chunk_grpo.train.export`):
    final_model/ (a diffusers directory, LoRA merged), final_lora/, final_transformer/; EMA
    weights if enabled; in bf16 where the frozen weights are bf16 (CUDA by default), else fp32.
    Every rank calls this: a sharded transformer is gathered onto rank 0's CPU, which writes.
    Returns {format: directory} (on rank 0)."""
    targets = export_targets(tr.run_dir, tr.cfg.run.export, tr.cfg.model.lora_rank > 0)
    if ("merged" in targets and not tr.policy.has_text_encoders  # freed after caching: rank 0
            and tr.info.is_main):  # writes the pipeline, it alone needs them
        tr.policy.reload_text_encoders("cpu")
    if tr.ema is not None:
        tr.ema.swap()
    dtype = resolve_weights_dtype(tr.cfg.model.weights_dtype, tr.info.device)
    try:
        if tr.info.world_size > 1 or is_sharded(tr.module):
            return export_full_model(tr.policy.pipeline, tr.module, targets,
                                     defaults=tr.policy.defaults, dtype=dtype)
        return write_exports(tr.policy.pipeline, tr.policy.transformer, targets,
                             defaults=tr.policy.defaults, dtype=dtype)
    finally:
        if tr.ema is not None:
            tr.ema.swap()
