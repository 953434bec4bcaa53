"""Paired comparison of two evaluations that sampled the same prompts from the same noise.

Two models evaluated with the same prompts, seed and images per prompt start every image from
the same initial noise, so the per-image reward differences cancel the prompt-to-prompt and
noise-to-noise spread that dominates each model's own confidence interval. The paired CI is the
one that answers "did training help?".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chunk_grpo.evaluate.stats import mean_ci95

SAMPLE_DECIMALS = 4  # rewards in samples.jsonl are rounded to this many decimals


@dataclass
class PairedDifference:
    baseline: str  # the baseline evaluation's directory
    diff_mean: float  # mean of (this reward - baseline reward) over images
    diff_ci95: float  # half-width of its 95% CI (Student t over the n differences)
    changed_fraction: float  # images whose reward moved by more than 0.01
    n: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def load_samples(eval_dir: str | Path) -> tuple[list[str], np.ndarray, dict]:
    """(prompts, rewards, settings) of a `python -m chunk_grpo.evaluate` output directory."""
    eval_dir = Path(eval_dir)
    samples, metrics = eval_dir / "samples.jsonl", eval_dir / "metrics.json"
    if not samples.is_file() or not metrics.is_file():
        raise ValueError(f"{eval_dir} is not an evaluation directory (no samples.jsonl and "
                         "metrics.json); give the --out of an earlier `chunk_grpo.evaluate` run")
    rows = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines() if line]
    settings = json.loads(metrics.read_text()).get("settings", {})
    return [r["prompt"] for r in rows], np.array([r["reward"] for r in rows]), settings


# Settings an evaluation of an earlier version saved under another name.
_FORMER_NAMES = {"run.seed": "seed"}


def _setting(settings: dict, key: str):
    """A saved setting by its dotted key, or by its former name; None when absent."""
    value = settings.get(key)
    return settings.get(_FORMER_NAMES.get(key, key)) if value is None else value


def paired_difference(prompts: list[str], rewards: np.ndarray, settings: dict,
                      baseline_dir: str | Path) -> PairedDifference:
    """This evaluation minus the one in ``baseline_dir``, image by image.

    Raises ValueError when the two did not sample the same images: other prompts (or order),
    another seed or another number of images per prompt.
    """
    base_prompts, base_rewards, base_settings = load_samples(baseline_dir)
    if base_prompts != list(prompts):
        raise ValueError(f"{baseline_dir} evaluated other prompts ({len(base_prompts)} images, "
                         f"this run {len(prompts)}); use the same --data.eval_prompts, "
                         "--max-prompts and --images-per-prompt")
    for key in ("run.seed", "images_per_prompt"):
        base, this = _setting(base_settings, key), _setting(settings, key)
        if base is not None and this is not None and base != this:
            raise ValueError(f"{baseline_dir} used {key}={base}, this run {this}: a paired "
                             "comparison needs the same initial noise")
    # Round like the stored baseline, so identical images differ by exactly 0.
    diff = np.round(np.asarray(rewards, dtype=np.float64), SAMPLE_DECIMALS) - base_rewards
    mean, half = mean_ci95(diff)
    return PairedDifference(str(baseline_dir), mean, half, float(np.mean(np.abs(diff) > 0.01)),
                            int(diff.size))
