"""The chunk ablation at toy scale (the paper's Table 3): ``python -m chunk_grpo.ablate``.

    python -m chunk_grpo.ablate [--out DIR] [--cells step,chunk2,...] [--seeds 0,1,2]
                                [--minutes M] [--eval-images N] [--eval-seed S] [--quick]
                                [any flag of python -m chunk_grpo.train]

Each cell is a set of config overrides (`CELLS`) on top of one base config: the trainer's
defaults, then every step stochastic (``sde_window: 0``, the paper's setting; the default's 3
trained transitions are too few for chunks of 2 and 4 to differ), then the flags passed through.
Every (cell, seed) is a full trainer run in OUT/cells/<cell>-s<seed>/ with the same wall-time
budget (equal compute), then a held-out evaluation of its final model, paired image by image with
the base model's evaluation of the same prompts and initial noise (OUT/base_eval.json and .pt).

Resumable: a finished run is recorded in its result.json (written atomically) and skipped on a
rerun; an interrupted run resumes from its trainer checkpoint with the rest of its time budget.
Outputs: OUT/table.md (also printed), OUT/curves.png (training reward per iteration, mean over
seeds) and OUT/ablation.json (the settings; a rerun with other settings is refused).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from chunk_grpo.config.decoding import dotted_keys
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config, load_yaml, parse_args
from chunk_grpo.config.schema import TrainConfig
from chunk_grpo.data.prompts import load_prompts
from chunk_grpo.evaluate.evaluation import evaluate_policy
from chunk_grpo.evaluate.stats import mean_ci95
from chunk_grpo.rewards import get_reward
from chunk_grpo.runtime import distributed as D
from chunk_grpo.train.checkpoint import latest_checkpoint, load_checkpoint
from chunk_grpo.train.loop import run as train_run
from chunk_grpo.train.metrics import read_metrics
from chunk_grpo.train.plots import line_plot
from chunk_grpo.train.setup import load_policy, resolve_reward

PROG = "python -m chunk_grpo.ablate"


@dataclass(frozen=True)
class Cell:
    name: str
    description: str
    overrides: dict[str, Any]


# What a cell varies; each cell sets all of these, so none leaks from one cell into another.
_CHUNK_GRPO = {"sampling.algorithm": "chunk_grpo", "chunks.size": None, "chunks.weighted": False,
               "chunks.fraction": 1.0}
CELLS: dict[str, Cell] = {c.name: c for c in (
    Cell("step", "step-level GRPO: every transition its own chunk",
         {**_CHUNK_GRPO, "chunks.spec": "step"}),
    Cell("chunk2", "fixed chunks of 2 transitions (the last takes the remainder)",
         {**_CHUNK_GRPO, "chunks.spec": "step", "chunks.size": 2}),
    Cell("chunk4", "fixed chunks of 4 transitions (the last takes the remainder)",
         {**_CHUNK_GRPO, "chunks.spec": "step", "chunks.size": 4}),
    Cell("sequence", "the whole window as one chunk (sequence level)",
         {**_CHUNK_GRPO, "chunks.spec": "sequence"}),
    Cell("auto", "chunks from the temporal-dynamics profile",
         {**_CHUNK_GRPO, "chunks.spec": "auto"}),
    Cell("auto-ws", "auto chunks, half of them trained per iteration, drawn by dynamics weight",
         {**_CHUNK_GRPO, "chunks.spec": "auto", "chunks.fraction": 0.5,
          "chunks.weighted": True}),
    Cell("g2rpo", "G2RPO: one branch step per iteration, finished at several strides",
         {"sampling.algorithm": "g2rpo", "chunks.spec": "step", "chunks.size": None,
          "chunks.weighted": False, "chunks.fraction": 1.0}),
)}
CELL_KEYS = (*_CHUNK_GRPO, "chunks.spec")

# The ablation's base on top of the trainer's defaults; flags passed through override these.
# The reward is JPEG compressibility alone, the reward its measured results use
# (docs/results/ablation.md); a --reward.name flag replaces it.
ABLATION_DEFAULTS: dict[str, Any] = {
    "sampling.sde_window": 0, "run.checkpoint_every": 1, "run.image_grid_every": 0,
    "run.progress": False,  # one bar: the ablation's
    "reward.name": "jpeg_compressibility"}
# Set by the ablation for every run; passing them through is an error that names the flag to use.
RESERVED = {
    "run.seed": "--seeds", "run.output_dir": "--out", "run.max_minutes": "--minutes",
    **{key: "--eval-images (the ablation evaluates every run itself)"
       for key in ("eval.images", "eval.every", "eval.hybrid_steps", "eval.final_images")},
    **{key: "--cells (the cells set it)" for key in CELL_KEYS},
}
# The trainer's own evaluation shrinks to one image at the end (the ablation evaluates itself);
# the end-of-run evaluation in metrics.jsonl also marks a run that finished training.
RUN_FIXED = {"eval.every": 0, "eval.images": 1, "eval.final_images": 1, "eval.hybrid_steps": 0}
TIME_LIMITED_MAX_STEPS = 1_000_000  # with a time budget the clock, not the step count, stops

# --quick: the whole default ablation (7 cells x 3 seeds) in about 21 minutes on one core of the
# 2-core AVX2 CPU, from measured CPU seconds (docs/results/ablation.md): 45 s of training
# per run at 2 prompts x 8 images per iteration (~9.5 s each, ~5 iterations), 16 eval images.
QUICK = dict(minutes=0.75, eval_images=16)
# unless passed: a default iteration (64 images) takes ~35 s
QUICK_BASE = {"sampling.prompts_per_step": 2}
SHAPES_METRICS = (("colour", "colour_acc"), ("shape", "shape_acc"), ("count", "count_acc"),
                  ("position", "spatial_acc"))


# ----------------------------------------------------------------------------- the cells

def parse_cells(text: str) -> list[Cell]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"--cells is empty; choose from {', '.join(CELLS)}")
    for name in names:
        if name not in CELLS:
            raise ConfigError(f"unknown cell {name!r}; choose from {', '.join(CELLS)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"--cells names a cell twice: {text!r}")
    return [CELLS[n] for n in names]


def parse_seeds(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ConfigError("--seeds is empty; give training seeds like 0,1,2")
    try:
        seeds = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated integers like 0,1,2, got {text!r}"
                          ) from None
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ConfigError(f"--seeds must be distinct non-negative integers, got {text!r}")
    return seeds


def base_values(yaml_path: str | None, flags: dict[str, Any]) -> dict[str, Any]:
    """The base config's values: ABLATION_DEFAULTS < YAML file < flags (trainer defaults below
    all of them). Raises ConfigError for a flag the ablation sets itself."""
    values = dict(ABLATION_DEFAULTS)
    # By dotted key, whichever way (nested or dotted) the preset spells them.
    preset = load_yaml(yaml_path) if yaml_path else {}
    values.update(dotted_keys(TrainConfig, preset, str(yaml_path)))
    for key, value in dotted_keys(TrainConfig, flags, "the command line").items():
        if key in RESERVED:
            raise ConfigError(f"--{key} is set by the ablation; use {RESERVED[key]}")
        values[key] = value
    for key in RESERVED:  # a YAML preset may name them: the ablation decides
        values.pop(key, None)
    return values


def run_values(base: dict[str, Any], minutes: float) -> dict[str, Any]:
    """The base values of every run: the budget and the settings the ablation fixes."""
    values = {**base, **RUN_FIXED, "run.max_minutes": minutes}
    if minutes > 0 and "run.max_steps" not in base:
        values["run.max_steps"] = TIME_LIMITED_MAX_STEPS
    return values


def cell_config(base: dict[str, Any], cell: Cell, seed: int, minutes: float) -> TrainConfig:
    """The trainer config of one (cell, seed) run. Raises ConfigError naming the cell."""
    values = {**run_values(base, minutes), **cell.overrides, "run.seed": seed}
    try:
        cfg = build_config(None, values)
    except ConfigError as err:
        raise ConfigError(f"cell {cell.name}: {err}") from None
    size = cfg.chunks.size or 1
    if size > cfg.num_trained:
        raise ConfigError(
            f"cell {cell.name}: chunk size {size} exceeds the {cfg.num_trained} trained "
            f"transitions (num_steps {cfg.sampling.steps}, sde_window "
            f"{cfg.sampling.sde_window}); use "
            "--sampling.sde_window 0 (every step) or a larger one, or leave the cell out with "
            "--cells")
    return cfg


def describe_chunks(cfg: TrainConfig, layouts: list[list[int]]) -> str:
    """The chunk column: the layout(s) the runs trained (auto may differ between seeds)."""
    if cfg.sampling.algorithm == "g2rpo":
        return (f"1 branch step of {cfg.num_trained}, finishes at strides "
                f"{cfg.sampling.g2rpo_granularities}")
    shown = " / ".join(dict.fromkeys("[" + ",".join(map(str, s)) + "]" for s in layouts))
    if cfg.chunks.fraction < 1:
        how = "weighted" if cfg.chunks.weighted else "uniform"
        shown += f", {cfg.chunks.fraction:g} of them per iteration ({how})"
    return shown


# ----------------------------------------------------------------------------- evaluation

def eval_prompts(cfg: TrainConfig, count: int) -> list[str]:
    """The first ``count`` held-out prompts (cycled), as the trainer's evaluation takes them."""
    prompts = load_prompts(cfg.data.eval_prompts)
    return [prompts[i % len(prompts)] for i in range(count)]


def shapes_accuracies(result, cfg: TrainConfig) -> dict[str, float]:
    """The `shapes` reward's per-attribute accuracies of an evaluation, when its prompts are
    shapes prompts (whatever the trained reward); empty otherwise."""
    if not cfg.data.eval_prompts.startswith("shapes:"):
        return {}
    attrs = result.attributes
    if "colour_acc" not in attrs:
        details = get_reward("shapes").details(result.images, result.prompts)
        attrs = {}
        for key, values in details.items():
            finite = values[~torch.isnan(values)]
            attrs[key] = float(finite.mean()) if finite.numel() else math.nan
    return {key: attrs[key] for _, key in SHAPES_METRICS if key in attrs}


def evaluate_model(policy, cfg: TrainConfig, count: int, noise_seed: int, reward) -> dict:
    """Held-out ``reward`` of every image (ODE, the model's sampling defaults) and the shapes
    accuracies; the same (prompts, noise_seed) give the same initial noise for every model."""
    res = evaluate_policy(policy, eval_prompts(cfg, count), reward=reward,
                          seed=noise_seed, cfg_scale=cfg.sampling.cfg_scale,
                          batch_size=cfg.sampling.batch_size)
    return {"reward_mean": res.reward_mean, "rewards": res.rewards.tolist(),
            "shapes": shapes_accuracies(res, cfg)}


def base_evaluations(out: Path, cfg: TrainConfig, count: int, noise_seeds: list[int],
                     device: torch.device, reward) -> dict[int, dict]:
    """The base model's evaluation for each noise seed, computed once and cached in
    OUT/base_eval.json (summaries) and OUT/base_eval.pt (per-image rewards)."""
    summary_path, rewards_path = out / "base_eval.json", out / "base_eval.pt"
    cached: dict[int, dict] = {}
    if summary_path.is_file() and rewards_path.is_file():
        summaries = json.loads(summary_path.read_text())
        rewards = torch.load(rewards_path, weights_only=True)
        cached = {int(s): dict(summaries[s], rewards=rewards[s].tolist()) for s in summaries}
    missing = [s for s in noise_seeds if s not in cached]
    if missing:
        policy = load_policy(cfg, device)
        for seed in missing:
            cached[seed] = evaluate_model(policy, cfg, count, seed, reward)
        _atomic_save_torch({str(s): torch.tensor(e["rewards"]) for s, e in cached.items()},
                           rewards_path)
        _atomic_write(summary_path, json.dumps(
            {str(s): {k: v for k, v in e.items() if k != "rewards"} for s, e in cached.items()},
            indent=2))
    return {s: cached[s] for s in noise_seeds}


# ----------------------------------------------------------------------------- one run

class _TrainingClock:
    """The trainer's loop time at the end of each iteration, kept in run_dir/timing.json so a
    resumed run gets only the rest of its budget. The loop's start is the first iteration's end
    minus its phase times (rollout, reward, train, eval)."""

    def __init__(self, run_dir: Path, used: float, elapsed: dict[str, float], then=None):
        self.path, self.used, self.elapsed, self.then = run_dir / "timing.json", used, elapsed, then
        self.start: float | None = None

    def __call__(self, step: int, metrics: dict) -> None:
        now = time.time()
        if self.start is None:
            self.start = now - sum(v for k, v in metrics.items()
                                   if k.startswith("time/") and isinstance(v, (int, float)))
        self.elapsed[str(step)] = self.used + now - self.start
        _atomic_write(self.path, json.dumps({"elapsed": self.elapsed}))
        if self.then is not None:
            self.then(step, metrics)


def train_resumably(cfg: TrainConfig, run_dir: Path, on_step_end=None,
                    trust_checkpoint: bool = False) -> dict:
    """Train one run to the end of its budget: fresh, or resumed from its latest checkpoint with
    the budget it has left. Returns {"iterations", "seconds"} of the whole run."""
    checkpoint = latest_checkpoint(run_dir)
    timing = run_dir / "timing.json"
    if checkpoint is None:
        if run_dir.exists():  # stopped before its first checkpoint: nothing to keep
            shutil.rmtree(run_dir)
        clock = _TrainingClock(run_dir, 0.0, {}, on_step_end)
        train_run(cfg, run_dir=run_dir, on_step_end=clock)
    else:
        step = int(checkpoint.name.split("-")[1])
        elapsed = json.loads(timing.read_text())["elapsed"] if timing.is_file() else {}
        elapsed = {s: t for s, t in elapsed.items() if int(s) <= step}
        used = elapsed.get(str(step), max(elapsed.values(), default=0.0))
        records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] == step]
        if records and "eval/reward_mean" in records[-1]:
            # The checkpoint is the run's last iteration (the trainer evaluates only at the end):
            # it was stopped while exporting. Export without training further.
            cfg = cfg.with_changes({"run.max_steps": step})
        elif cfg.run.max_minutes > 0:
            # Stopped just as the budget ran out: a tiny budget trains one more iteration.
            cfg = cfg.with_changes({"run.max_minutes": max(cfg.run.max_minutes - used / 60, 1e-6)})
        clock = _TrainingClock(run_dir, used, elapsed, on_step_end)
        train_run(cfg, run_dir=run_dir, resume=True, on_step_end=clock,
                  trust_checkpoint=trust_checkpoint)
    steps = sorted(int(s) for s in clock.elapsed)
    return {"iterations": steps[-1] if steps else 0,
            "seconds": clock.elapsed[str(steps[-1])] if steps else 0.0}


def run_one(cell: Cell, seed: int, cfg: TrainConfig, out: Path, count: int, noise_seed: int,
            base_eval: dict, device: torch.device, reward, on_step_end=None,
            trust_checkpoint: bool = False) -> dict:
    """Train, evaluate and record one (cell, seed); a recorded one is read back, not rerun."""
    run_dir = out / "cells" / f"{cell.name}-s{seed}"
    result_path = run_dir / "result.json"
    if result_path.is_file():
        return json.loads(result_path.read_text())
    trained_path = run_dir / "trained.json"
    if trained_path.is_file():  # trained, stopped during the evaluation
        trained = json.loads(trained_path.read_text())
    else:
        trained = train_resumably(cfg, run_dir, on_step_end, trust_checkpoint)
        trained["chunk_layout"] = load_checkpoint(run_dir, names=("run",))["run"]["chunk_layout"]
        _atomic_write(trained_path, json.dumps(trained))
    policy = load_policy(cfg.with_changes({"model.name": str(run_dir / "final_model")}), device)
    evaluation = evaluate_model(policy, cfg, count, noise_seed, reward)
    diffs = np.asarray(evaluation["rewards"]) - np.asarray(base_eval["rewards"])
    gain, gain_ci = mean_ci95(diffs)
    result = dict(cell=cell.name, seed=seed, noise_seed=noise_seed, **trained,
                  eval=evaluation, gain=gain, gain_ci95_images=gain_ci)
    _atomic_write(result_path, json.dumps(result, indent=2))
    return result


# ----------------------------------------------------------------------------- the report

def _fmt(value: float, digits: int = 3) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def summarise(cells: list[Cell], configs: dict[str, TrainConfig], results: dict[str, list[dict]],
              base: dict[int, dict]) -> list[list[str]]:
    """The table's rows: the base model, then each cell (mean over seeds)."""

    def shapes_columns(evals: list[dict]) -> list[str]:
        return [_fmt(float(np.nanmean([e["shapes"].get(key, math.nan) for e in evals])))
                if any(key in e["shapes"] for e in evals) else "–" for _, key in SHAPES_METRICS]

    base_mean = float(np.mean([e["reward_mean"] for e in base.values()]))
    rows = [["base (no training)", "–", f"0 (reward {base_mean:.3f})",
             *shapes_columns(list(base.values())), "–", "0"]]
    for cell in cells:
        runs = results[cell.name]
        gain, ci = mean_ci95([r["gain"] for r in runs])
        gain_text = (f"{gain:+.3f} ± {ci:.3f}" if math.isfinite(ci)
                     else f"{gain:+.3f} (1 seed: no CI)")
        rows.append([cell.name, describe_chunks(configs[cell.name],
                                                [r["chunk_layout"] for r in runs]),
                     gain_text, *shapes_columns([r["eval"] for r in runs]),
                     f"{np.mean([r['seconds'] for r in runs]):.0f}",
                     "/".join(str(r["iterations"]) for r in runs)])
    return rows


def table_markdown(rows: list[list[str]], header: list[str]) -> str:
    columns = ["cell", "chunks", "held-out gain (95% CI)", *(n for n, _ in SHAPES_METRICS),
               "s", "iterations"]
    lines = [*header, "", "| " + " | ".join(columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def table_header(base_cfg: TrainConfig, seeds: list[int], minutes: float, count: int,
                 eval_seed: int) -> list[str]:
    budget = (f"{minutes:g} minutes of training wall time per run (the trainer's max_minutes; "
              f"the iteration under way when it runs out finishes)" if minutes > 0
              else f"{base_cfg.run.max_steps} iterations per run")
    window = (f"every step stochastic (sde_window 0, the paper's setting and the ablation's "
              f"default; the trainer's own default trains only the first "
              f"{TrainConfig().sampling.sde_window} transitions)"
              if base_cfg.sampling.sde_window == 0
              else f"sde_window {base_cfg.sampling.sde_window}")
    return [
        "# Chunk ablation (toy-scale Table 3)",
        "",
        f"Model {base_cfg.model.name}, reward {base_cfg.reward.name}, "
        f"{base_cfg.sampling.steps} sampling steps, "
        f"{window}: {base_cfg.num_trained} trained transitions; "
        f"{base_cfg.sampling.prompts_per_step} prompts x {base_cfg.sampling.group_size} images "
        f"per iteration.",
        f"Equal compute: {budget}. Seeds {','.join(map(str, seeds))}; 's' is the mean training "
        f"time per run, 'iterations' those of each seed.",
        f"Held-out gain: {count} images of {base_cfg.data.eval_prompts} (ODE, the model's sampling "
        f"defaults) minus the base model's on the same prompts and initial noise (noise seed "
        f"{eval_seed} + training seed); the mean over seeds of each run's mean paired gain, "
        f"with a 95% Student-t interval over the seeds. colour/shape/count/position: the "
        f"`shapes` reward's accuracies on those images, mean over seeds.",
    ]


def reward_curves(cells: list[Cell], out: Path, seeds: list[int], path: Path) -> Path | None:
    """Training reward per iteration, mean over seeds up to the iteration every seed reached."""
    series = {}
    for cell in cells:
        per_seed = []
        for seed in seeds:
            log = out / "cells" / f"{cell.name}-s{seed}" / "metrics.jsonl"
            rows = [r for r in read_metrics(log) if isinstance(r.get("reward_mean"), float)]
            per_seed.append({r["step"]: r["reward_mean"] for r in rows})
        common = sorted(set.intersection(*(set(s) for s in per_seed)))
        if common:
            series[cell.name] = (common, [float(np.mean([s[i] for s in per_seed]))
                                          for i in common])
    if not series:
        return None
    title = f"training reward per iteration (mean over {len(seeds)} seed{'s' * (len(seeds) > 1)})"
    if len(series) == 1:  # line_plot draws no legend for one series: the title names it
        title = f"{next(iter(series))}: {title}"
    return line_plot(series, path, title=title, xlabel="iteration", ylabel="training reward")


# ----------------------------------------------------------------------------- the ablation

def check_settings(out: Path, settings: dict) -> None:
    """Record the ablation's settings in OUT/ablation.json; refuse a rerun that changes them
    (its finished cells would mix two experiments)."""
    path = out / "ablation.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        for key in sorted(set(saved) | set(settings)):
            if saved.get(key) != settings.get(key):
                raise ConfigError(f"{out} holds an ablation with other settings ({key}: "
                                  f"{saved.get(key)!r} there, {settings.get(key)!r} now); rerun "
                                  f"with the same flags or choose another --out")
    else:
        out.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, json.dumps(settings, indent=2))


def run_ablation(out: Path, cells: list[Cell], seeds: list[int], base: dict[str, Any],
                 minutes: float, count: int, eval_seed: int = 1000, on_step_end=None,
                 progress: bool = True, trust_checkpoint: bool = False) -> str:
    """Run (or finish) every (cell, seed), write table.md and curves.png; returns the table."""
    if minutes < 0:
        raise ConfigError(f"--minutes must be >= 0 (0 = no time limit), got {minutes}")
    if minutes == 0 and "run.max_steps" not in base:
        raise ConfigError("--minutes 0 needs --run.max_steps N (equal iterations instead of equal "
                          "time)")
    if count < 2:
        raise ConfigError(f"--eval-images must be >= 2 (a paired gain needs images), got {count}")
    configs = {c.name: cell_config(base, c, seeds[0], minutes) for c in cells}
    for cell in cells:  # every seed's config is valid before anything runs
        for seed in seeds[1:]:
            cell_config(base, cell, seed, minutes)
    base_cfg = build_config(None, run_values(base, minutes))
    info = D.init_for_config(base_cfg)
    if info.world_size > 1:
        raise ConfigError("the ablation runs in one process; start it without torchrun")
    check_settings(out, {"base": base_cfg.to_dict(), "minutes": minutes, "eval_images": count,
                         "eval_seed": eval_seed})
    noise_seeds = {seed: eval_seed + seed for seed in seeds}
    reward = resolve_reward(base_cfg)
    base_evals = base_evaluations(out, base_cfg, count, list(noise_seeds.values()), info.device,
                                  reward)
    results: dict[str, list[dict]] = {c.name: [] for c in cells}
    jobs = [(cell, seed) for cell in cells for seed in seeds]
    bar = tqdm(jobs, desc="ablation", disable=not progress)
    for cell, seed in bar:
        bar.set_postfix(run=f"{cell.name}-s{seed}")
        cfg = cell_config(base, cell, seed, minutes)
        result = run_one(cell, seed, cfg, out, count, noise_seeds[seed],
                         base_evals[noise_seeds[seed]], info.device, reward, on_step_end,
                         trust_checkpoint)
        results[cell.name].append(result)
        if progress:
            tqdm.write(f"{cell.name}-s{seed}: {result['iterations']} iterations in "
                       f"{result['seconds']:.0f} s; held-out gain {result['gain']:+.4f} +- "
                       f"{result['gain_ci95_images']:.4f} (95% CI over its images)")
    rows = summarise(cells, configs, results, base_evals)
    table = table_markdown(rows, table_header(base_cfg, seeds, minutes, count, eval_seed))
    _atomic_write(out / "table.md", table)
    reward_curves(cells, out, seeds, out / "curves.png")
    return table


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text if text.endswith("\n") else text + "\n")
    os.replace(tmp, path)


def _atomic_save_torch(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@dataclass
class AblationArgs:
    out: Path
    cells: list[Cell]
    seeds: list[int]
    base: dict[str, Any]  # the base config's values (before the cells' overrides)
    minutes: float
    eval_images: int
    eval_seed: int
    trust_checkpoint: bool = False  # resume cells' checkpoints without a manifest


def parse_ablation_args(argv: list[str] | None = None, prog: str = PROG) -> AblationArgs:
    """The command line: the ablation's own flags, the rest as the trainer's (the base)."""
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description="The chunk ablation (the paper's Table 3) at toy scale: every cell x seed "
                    "is a trainer run with the same wall time, evaluated on held-out prompts "
                    "against the base model. Rerun the same command to continue an interrupted "
                    "ablation. Other flags are those of chunk_grpo.train (the base config).")
    parser.add_argument("--out", default="runs/ablation", help="output directory")
    parser.add_argument("--cells", default=",".join(CELLS),
                        help=f"comma-separated cells (default: all of {', '.join(CELLS)})")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds (default 0,1,2)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="training wall time per run (default 10; --quick "
                             f"{QUICK['minutes']}; 0 = no limit, with --max-steps)")
    parser.add_argument("--eval-images", type=int, default=None,
                        help=f"held-out images per evaluation (default 64; --quick "
                             f"{QUICK['eval_images']})")
    parser.add_argument("--eval-seed", type=int, default=1000,
                        help="noise seed of the evaluation of training seed 0 (seed s: this + s)")
    parser.add_argument("--quick", action="store_true",
                        help="a short budget: the whole ablation in about 21 minutes on 2 cores "
                             f"({QUICK['minutes']} min per run, 2 prompts per iteration)")
    args, rest = parser.parse_known_args(argv)
    yaml_path, flags, resume, trust = parse_args(rest, prog=prog, trust_flag=True)
    if resume:
        raise ConfigError("--resume is not an ablation flag: rerun the same command and "
                          "finished runs are skipped, interrupted ones resume")
    minutes = args.minutes if args.minutes is not None else (
        QUICK["minutes"] if args.quick else 10.0)
    count = args.eval_images if args.eval_images is not None else (
        QUICK["eval_images"] if args.quick else 64)
    base = base_values(yaml_path, flags)
    if args.quick:
        base = {**QUICK_BASE, **base}
    return AblationArgs(Path(args.out), parse_cells(args.cells), parse_seeds(args.seeds), base,
                        minutes, count, args.eval_seed, trust)
