"""The one screen a training run ends with: did the reward move, did prompt fidelity hold, where
everything is, and what to run next. Also the before/after image pairs of the held-out
evaluation.

The gain is paired: the base model and the trained one sample the same prompts from the same
initial noise, so the per-image differences cancel the prompt-to-prompt spread (see
`chunk_grpo.paired`), and its 95% CI is much narrower than either model's own.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from chunk_grpo.stats import mean_ci95

# The GenEval-like checks of the shapes world, in the order a reader scans them.
FIDELITY_KEYS = (("colour_acc", "colour"), ("shape_acc", "shape"), ("size_acc", "size"),
                 ("count_acc", "count"), ("spatial_acc", "position"), ("exact", "exact"))


@dataclass
class Comparison:
    """One held-out evaluation of the trained model against the base on the same images."""

    name: str  # "eval" (the trained model alone) or "eval_hybrid"
    before: float
    before_ci95: float
    after: float
    after_ci95: float
    gain: float  # mean paired difference after - before
    gain_ci95: float
    changed_fraction: float  # images whose reward moved by more than 0.01
    n: int
    attributes_before: dict[str, float]
    attributes_after: dict[str, float]

    @classmethod
    def of(cls, name: str, base, trained) -> Comparison:
        """From two `EvalResult`s of the same prompts and seed."""
        if base.prompts != trained.prompts:
            raise ValueError("a paired comparison needs the same prompts in the same order")
        diff = trained.rewards.double() - base.rewards.double()
        gain, gain_ci = mean_ci95(diff)
        return cls(name, base.reward_mean, base.reward_ci95, trained.reward_mean,
                   trained.reward_ci95, gain, gain_ci, float((diff.abs() > 0.01).double().mean()),
                   trained.n, dict(base.attributes), dict(trained.attributes))

    @property
    def significant(self) -> bool:
        return self.gain - self.gain_ci95 > 0 or self.gain + self.gain_ci95 < 0


def _signed(value: float) -> str:
    return f"{value:+.3f}"


def summary_text(*, run_dir: Path, reward: str, comparisons: list[Comparison], iterations: int,
                 minutes: float, hybrid_steps: int, model_dir: Path | None,
                 exports: dict[str, Path] | None = None,
                 eval_dir_hint: str = "runs/eval-base", updates: dict[str, int] | None = None
                 ) -> str:
    """The summary as printed (plain text, under 80 columns wide where it can be). ``updates``:
    the run's optimizer steps, skipped steps and skipped iterations (`STEP_COUNTS`);
    ``exports``: {format: directory} of the model's exports beside ``model_dir`` (the merged)."""
    lines = ["", "=" * 72, f"chunk-grpo run finished: {run_dir}", "=" * 72]
    per_iteration = 60 * minutes / iterations if iterations else float("nan")
    lines.append(f"trained   {iterations} iterations in {minutes:.1f} min "
                 f"({per_iteration:.2f} s per iteration)")
    if updates is not None:
        lines.append(f"updates   {updates['optimizer_steps']} optimizer steps, "
                     f"{updates['skipped_steps']} skipped (NaN/Inf loss or gradient), "
                     f"{updates['reward_skipped']} iterations skipped (NaN/Inf reward)")
    for c in comparisons:
        if c.name == "eval":
            lines.append(f"held-out  {reward} on {c.n} held-out images (the same noise before "
                         "and after)")
        else:
            lines.append(f"hybrid    the first {hybrid_steps} steps by the trained model, the "
                         "rest by the base")
        lines.append(f"          before {c.before:.3f} +- {c.before_ci95:.3f}   ->   after "
                     f"{c.after:.3f} +- {c.after_ci95:.3f}")
        low, high = c.gain - c.gain_ci95, c.gain + c.gain_ci95
        verdict = ("up, beyond noise" if low > 0 else "down, beyond noise" if high < 0
                   else "within noise of the base")
        lines.append(f"          paired gain {_signed(c.gain)} (95% CI {_signed(low)} .. "
                     f"{_signed(high)}): {verdict}; {100 * c.changed_fraction:.0f}% of images "
                     "changed")
        keys = [(k, label) for k, label in FIDELITY_KEYS
                if k in c.attributes_before and k in c.attributes_after]
        if keys:
            cells = [f"{label} {c.attributes_before[k]:.2f}->{c.attributes_after[k]:.2f}"
                     for k, label in keys]
            lines.append("          shapes checks: " + ", ".join(cells[:3]))
            if cells[3:]:
                lines.append("                         " + ", ".join(cells[3:]))
    if not comparisons:
        lines.append("held-out  no base model to compare against (eval_hybrid_steps: 0 loads "
                     "none)")
    lines.append(f"images    {run_dir / 'images'} (rollouts, evaluations, before_after.png)")
    lines.append(f"metrics   {run_dir / 'metrics.jsonl'} (TensorBoard: {run_dir / 'tensorboard'})")
    if model_dir is not None:
        quoted = shlex.quote(str(model_dir))
        lines.append(f"model     {model_dir}")
        lines.append(f"evaluate  python -m chunk_grpo.evaluate --out {eval_dir_hint}   (once)")
        lines.append(f"          python -m chunk_grpo.evaluate --model {quoted} --compare "
                     f"{eval_dir_hint}")
    exports = exports or {}
    if "lora" in exports:
        lines.append(f"lora      {exports['lora'] / 'pytorch_lora_weights.safetensors'}")
        lines.append("          (diffusers: FluxPipeline.load_lora_weights on the base model)")
    if "transformer" in exports:
        lines.append(f"weights   {exports['transformer']} (the merged FluxTransformer2DModel "
                     "alone)")
    lines.append(f"resume    python -m chunk_grpo.train --resume {shlex.quote(str(run_dir))} "
                 "--max-steps N --max-minutes M")
    lines.append("=" * 72)
    return "\n".join(lines)


def summary_numbers(comparisons: list[Comparison]) -> dict[str, float]:
    """The summary's numbers, flat ("final/eval/gain"), for a logging backend's run summary."""
    keys = ("before", "before_ci95", "after", "after_ci95", "gain", "gain_ci95",
            "changed_fraction", "n")
    out = {f"final/{c.name}/{key}": getattr(c, key) for c in comparisons for key in keys}
    for c in comparisons:
        out.update({f"final/{c.name}/{key}_before": v for key, v in c.attributes_before.items()})
        out.update({f"final/{c.name}/{key}_after": v for key, v in c.attributes_after.items()})
    return out


def save_summary(run_dir: Path, text: str, comparisons: list[Comparison]) -> None:
    """RUN/summary.txt (the screen) and RUN/summary.json (the numbers)."""
    (run_dir / "summary.txt").write_text(text.lstrip("\n") + "\n")
    data = {c.name: dict(c.__dict__) for c in comparisons}
    (run_dir / "summary.json").write_text(json.dumps(data, indent=2) + "\n")


def before_after_pairs(base, trained, pairs: int = 16) -> tuple[torch.Tensor, list[str]]:
    """Each held-out image of the base beside the trained model's image from the same noise,
    captioned with its reward: the images and captions of a grid of 4 pairs per row."""
    k = min(pairs, base.images.shape[0], trained.images.shape[0])
    images = torch.stack([img for i in range(k)
                          for img in (base.images[i], trained.images[i])])
    captions = [text for i in range(k) for text in (
        f"before {float(base.rewards[i]):.2f}  {base.prompts[i]}",
        f"after {float(trained.rewards[i]):.2f}")]
    return images, captions
