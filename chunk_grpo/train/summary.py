"""The one screen a training run ends with: did the reward move, did the guard reward (prompt
fidelity) hold, which chunks trained, where everything is, and what to run next. Also the
before/after image pairs of the held-out evaluation.

The gain is paired: the base model and the trained one sample the same prompts from the same
initial noise, so the per-image differences cancel the prompt-to-prompt spread (see
`chunk_grpo.evaluate.paired`), and its 95% CI is much narrower than either model's own. The guard's
change is paired the same way (`paired_gain`), and the two directions give the verdict
(`guard_verdict`): a reward up while the guard is down is reward hacking.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from chunk_grpo.evaluate.stats import mean_ci95

# The GenEval-like checks of the shapes world, in the order a reader scans them.
FIDELITY_KEYS = (("colour_acc", "colour"), ("shape_acc", "shape"), ("size_acc", "size"),
                 ("count_acc", "count"), ("spatial_acc", "position"), ("exact", "exact"))


CHANGED = 0.01  # a per-image score that moved by more than this counts as changed


def paired_gain(before: torch.Tensor, after: torch.Tensor) -> tuple[float, float, float]:
    """(mean of after - before, the half-width of its 95% CI, the fraction of images whose score
    moved by more than `CHANGED`) of per-image scores of the same images, before and after."""
    diff = torch.as_tensor(after).double() - torch.as_tensor(before).double()
    gain, ci = mean_ci95(diff)
    return gain, ci, float((diff.abs() > CHANGED).double().mean())


def direction(gain: float, ci95: float) -> str:
    """"up" or "down" when the 95% CI of a paired gain excludes zero, else "flat" (also when
    the CI is unknown, with fewer than 2 images)."""
    if gain - ci95 > 0:
        return "up"
    if gain + ci95 < 0:
        return "down"
    return "flat"


_DIRECTION_WORDS = {"up": "up, beyond noise", "down": "down, beyond noise",
                    "flat": "within noise of the base"}
# (trained reward, guard) directions -> the verdict; {g} is the guard's name.
VERDICTS = {
    ("up", "down"): "reward up, {g} down: reward hacking",
    ("up", "flat"): "reward up, {g} within noise: a gain that kept {g}",
    ("up", "up"): "reward up, {g} up: both improved",
    ("flat", "down"): "reward within noise, {g} down: {g} lost for no gain",
    ("flat", "flat"): "reward and {g} within noise: no measurable change",
    ("flat", "up"): "reward within noise, {g} up",
    ("down", "down"): "reward down, {g} down: training hurt both",
    ("down", "flat"): "reward down, {g} within noise",
    ("down", "up"): "reward down, {g} up",
}


def guard_verdict(reward_gain: float, reward_ci95: float, guard_gain: float,
                  guard_ci95: float, guard: str) -> str:
    """The verdict line of the trained reward's and the guard's paired gains, each read as up,
    down or flat by its own 95% CI (`direction`)."""
    key = (direction(reward_gain, reward_ci95), direction(guard_gain, guard_ci95))
    return VERDICTS[key].format(g=guard)


@dataclass
class GuardComparison:
    """The guard reward of one held-out evaluation, before and after, on the same images."""

    name: str  # the guard's metric label, e.g. "shapes"
    before: float
    before_ci95: float
    after: float
    after_ci95: float
    gain: float  # mean paired difference after - before
    gain_ci95: float
    changed_fraction: float
    n: int

    @classmethod
    def of(cls, name: str, before: torch.Tensor, after: torch.Tensor) -> GuardComparison:
        """From the guard's per-image scores of the base's and the trained model's images."""
        if before.shape != after.shape:
            raise ValueError(f"a paired guard comparison needs scores of the same images, got "
                             f"{tuple(before.shape)} and {tuple(after.shape)}")
        gain, gain_ci, changed = paired_gain(before, after)
        return cls(name, *mean_ci95(before), *mean_ci95(after), gain, gain_ci, changed,
                   int(after.numel()))


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
    guard: GuardComparison | None = None

    @classmethod
    def of(cls, name: str, base, trained, guard: str | None = None) -> Comparison:
        """From two `EvalResult`s of the same prompts and seed; with ``guard`` (its name) and
        the guard's scores in both, the guard's paired comparison too."""
        if base.prompts != trained.prompts:
            raise ValueError("a paired comparison needs the same prompts in the same order")
        gain, gain_ci, changed = paired_gain(base.rewards, trained.rewards)
        guarded = None
        if guard is not None and base.guard_scores is not None and (
                trained.guard_scores is not None):
            guarded = GuardComparison.of(guard, base.guard_scores, trained.guard_scores)
        return cls(name, base.reward_mean, base.reward_ci95, trained.reward_mean,
                   trained.reward_ci95, gain, gain_ci, changed, trained.n, dict(base.attributes),
                   dict(trained.attributes), guarded)

    @property
    def significant(self) -> bool:
        return direction(self.gain, self.gain_ci95) != "flat"

    @property
    def verdict(self) -> str | None:
        """The verdict of the reward's and the guard's gains (None without a guard)."""
        g = self.guard
        return None if g is None else guard_verdict(self.gain, self.gain_ci95, g.gain,
                                                     g.gain_ci95, g.name)


@dataclass
class ChunkReport:
    """Which chunks a run trained and how often: the layout, the draw, the count per chunk."""

    sizes: list[int]  # the chunk layout over the trained transitions
    trained: list[int]  # per chunk: the iterations whose update trained it
    iterations: int  # the run's iterations (its last step)
    per_iteration: int  # chunks trained per iteration (chunks.fraction of them, at least 1)
    weighted: bool  # chunks.weighted: drawn by the dynamics weights (else uniformly)
    sampling_steps: int  # T, of which the first sum(sizes) are trained

    @property
    def steps(self) -> list[tuple[int, int]]:
        """The first and last transition of each chunk."""
        out, start = [], 0
        for size in self.sizes:
            out.append((start, start + size - 1))
            start += size
        return out

    def lines(self) -> list[str]:
        """The summary's chunk lines (wrapped under 80 columns)."""
        k, n = self.per_iteration, len(self.sizes)
        spans = " | ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in self.steps)
        lines = [f"chunks    {self.sizes} over steps {spans} (of {self.sampling_steps} "
                 "sampling steps)"]
        if len(lines[0]) > 80:  # many chunks: the count, then the sizes wrapped
            lines = [f"chunks    {n} over steps 0-{self.steps[-1][1]} (of "
                     f"{self.sampling_steps} sampling steps), sizes"]
            lines.extend(_wrapped(" " * 10, [str(size) for size in self.sizes]))
        if k >= n:
            lines.append(f"          all {n} chunk(s) every iteration")
        else:
            draw = ("weighted by dynamics (chunks.weighted)" if self.weighted
                    else "drawn uniformly")
            lines.append(f"          {k} of {n} chunks per iteration, {draw}")
        cells = [f"{j}: {count}" for j, count in enumerate(self.trained)]
        lines.extend(_wrapped(f"          times trained over {self.iterations} iterations: ",
                              cells))
        return lines

    def as_dict(self) -> dict:
        return dict(dataclasses.asdict(self), steps=[list(s) for s in self.steps])


def _wrapped(head: str, cells: list[str], width: int = 78, indent: int = 10) -> list[str]:
    """``head`` then the cells joined by ", ", continued on lines indented by ``indent``
    past ``width``."""
    lines, line, fresh = [], head, True
    for i, cell in enumerate(cells):
        piece = cell + ("," if i < len(cells) - 1 else "")
        if len(line) + len(piece) > width and not fresh:
            lines.append(line.rstrip())
            line = " " * indent
        line, fresh = line + piece + " ", False
    lines.append(line.rstrip())
    return lines


def _signed(value: float) -> str:
    return f"{value:+.3f}"


def summary_text(*, run_dir: Path, reward: str, comparisons: list[Comparison], iterations: int,
                 minutes: float, hybrid_steps: int, model_dir: Path | None,
                 exports: dict[str, Path] | None = None,
                 eval_dir_hint: str = "runs/eval-base", updates: dict[str, int] | None = None,
                 chunks: ChunkReport | None = None, stopped: str | None = None) -> str:
    """The summary as printed (plain text, under 80 columns wide where it can be). ``updates``:
    the run's optimizer steps, skipped steps and skipped iterations (`STEP_COUNTS`);
    ``exports``: {format: directory} of the model's exports beside ``model_dir`` (the merged);
    ``chunks``: which chunks trained and how often; ``stopped``: why the run stopped before
    max_steps."""
    lines = ["", "=" * 72, f"chunk-grpo run finished: {run_dir}", "=" * 72]
    per_iteration = 60 * minutes / iterations if iterations else float("nan")
    lines.append(f"trained   {iterations} iterations in {minutes:.1f} min "
                 f"({per_iteration:.2f} s per iteration)")
    if updates is not None:
        lines.append(f"updates   {updates['optimizer_steps']} optimizer steps, "
                     f"{updates['skipped_steps']} skipped (NaN/Inf loss or gradient), "
                     f"{updates['reward_skipped']} iterations skipped (NaN/Inf reward)")
    if stopped:
        lines.extend(textwrap.wrap(stopped, 78, initial_indent="stopped   ",
                                   subsequent_indent=" " * 10))
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
        lines.append(f"          paired gain {_signed(c.gain)} (95% CI {_signed(low)} .. "
                     f"{_signed(high)}): {_DIRECTION_WORDS[direction(c.gain, c.gain_ci95)]}; "
                     f"{100 * c.changed_fraction:.0f}% of images changed")
        keys = [(k, label) for k, label in FIDELITY_KEYS
                if k in c.attributes_before and k in c.attributes_after]
        if keys:
            cells = [f"{label} {c.attributes_before[k]:.2f}->{c.attributes_after[k]:.2f}"
                     for k, label in keys]
            lines.append("          shapes checks: " + ", ".join(cells[:3]))
            if cells[3:]:
                lines.append("                         " + ", ".join(cells[3:]))
        if c.guard is not None:
            lines.extend(_guard_lines(c))
    if chunks is not None:
        lines.extend(chunks.lines())
    if not comparisons:
        lines.append("held-out  no base model to compare against (eval.hybrid_steps: 0 loads "
                     "none)")
    lines.append(f"images    {run_dir / 'images'} (rollouts, evaluations, before_after.png)")
    lines.append(f"metrics   {run_dir / 'metrics.jsonl'} (TensorBoard: {run_dir / 'tensorboard'})")
    if model_dir is not None:
        quoted = shlex.quote(str(model_dir))
        lines.append(f"model     {model_dir}")
        lines.append(f"evaluate  python -m chunk_grpo.evaluate --out {eval_dir_hint}   (once)")
        lines.append(f"          python -m chunk_grpo.evaluate --model.name {quoted} --compare "
                     f"{eval_dir_hint}")
    exports = exports or {}
    if "lora" in exports:
        lines.append(f"lora      {exports['lora'] / 'pytorch_lora_weights.safetensors'}")
        lines.append("          (diffusers: FluxPipeline.load_lora_weights on the base model)")
    if "transformer" in exports:
        lines.append(f"weights   {exports['transformer']} (the merged FluxTransformer2DModel "
                     "alone)")
    lines.append(f"resume    python -m chunk_grpo.train --resume {shlex.quote(str(run_dir))} "
                 "--run.max_steps N --run.max_minutes M")
    lines.append("=" * 72)
    return "\n".join(lines)


def _guard_lines(c: Comparison) -> list[str]:
    """The guard's before -> after, its paired gain and the verdict."""
    g = c.guard
    low, high = g.gain - g.gain_ci95, g.gain + g.gain_ci95
    return [f"guard     {g.name} before {g.before:.3f} +- {g.before_ci95:.3f}   ->   after "
            f"{g.after:.3f} +- {g.after_ci95:.3f}",
            f"          paired gain {_signed(g.gain)} (95% CI {_signed(low)} .. "
            f"{_signed(high)}): {_DIRECTION_WORDS[direction(g.gain, g.gain_ci95)]}",
            f"verdict   {c.verdict}"]


_KEYS = ("before", "before_ci95", "after", "after_ci95", "gain", "gain_ci95", "changed_fraction",
         "n")


def summary_numbers(comparisons: list[Comparison],
                    chunks: ChunkReport | None = None) -> dict[str, float]:
    """The summary's numbers, flat ("final/eval/gain", "final/eval/guard/gain",
    "final/chunks/trained_0"), for a logging backend's run summary."""
    out = {f"final/{c.name}/{key}": getattr(c, key) for c in comparisons for key in _KEYS}
    for c in comparisons:
        out.update({f"final/{c.name}/{key}_before": v for key, v in c.attributes_before.items()})
        out.update({f"final/{c.name}/{key}_after": v for key, v in c.attributes_after.items()})
        if c.guard is not None:
            out.update({f"final/{c.name}/guard/{key}": getattr(c.guard, key) for key in _KEYS})
    if chunks is not None:
        out.update({f"final/chunks/trained_{j}": n for j, n in enumerate(chunks.trained)})
    return out


def summary_data(comparisons: list[Comparison], chunks: ChunkReport | None = None,
                 stopped: str | None = None) -> dict:
    """RUN/summary.json's content: one entry per comparison ("eval", "eval_hybrid"; each with
    its "guard" and "verdict", None without a guard), and "chunks" and "stopped"."""
    data: dict = {}
    for c in comparisons:
        data[c.name] = dict(dataclasses.asdict(c), verdict=c.verdict)
    data["chunks"] = chunks.as_dict() if chunks is not None else None
    data["stopped"] = stopped
    return data


def save_summary(run_dir: Path, text: str, comparisons: list[Comparison],
                 chunks: ChunkReport | None = None, stopped: str | None = None) -> None:
    """RUN/summary.txt (the screen) and RUN/summary.json (the numbers, `summary_data`)."""
    (run_dir / "summary.txt").write_text(text.lstrip("\n") + "\n")
    data = summary_data(comparisons, chunks, stopped)
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
