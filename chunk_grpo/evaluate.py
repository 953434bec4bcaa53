"""Evaluate a model: sample images for a prompt set, score them, report the mean with a 95% CI.

    python -m chunk_grpo.evaluate --model PATH --prompts FILE --out DIR

Defaults: the embedded tiny model and the held-out shapes prompts. Writes DIR/metrics.json
(reward_mean, reward_ci95, n, per-attribute means when the reward has `details`, the settings),
DIR/samples.jsonl (prompt and reward of every image) and DIR/grid.png (images captioned with
their prompts and rewards). With --images-per-prompt N > 1 it also reports best-of-k for k = 2, 4,
.., N: the mean over prompts of the best of k images, the headroom that selecting among samples
offers (GRPO's group-relative update pushes the policy towards its best-of-G).
`evaluate_policy` is the same evaluation for code that already holds a FluxPolicy (the trainer's
periodic evaluation).
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont

from chunk_grpo.paired import SAMPLE_DECIMALS, paired_difference
from chunk_grpo.rewards import Reward, build_reward
from chunk_grpo.rollout import SDE_KINDS, generate
from chunk_grpo.shapes import HELDOUT_PROMPTS_FILE, load_prompts
from chunk_grpo.stats import best_of_k, mean_ci95


@dataclass
class EvalResult:
    reward_mean: float
    reward_ci95: float  # half-width of the 95% confidence interval of the mean
    n: int
    rewards: torch.Tensor  # [n] float32
    prompts: list[str]  # [n], the prompt of each image
    images: torch.Tensor  # [n, 3, H, W] in [0, 1]
    attributes: dict[str, float] = field(default_factory=dict)  # e.g. colour_acc, exact
    sampling_seconds: float = math.nan  # wall time of generate()
    images_per_prompt: int = 1  # images are prompt-major: prompt i owns rows i*N .. i*N+N-1

    def best_of(self) -> dict[int, tuple[float, float]]:
        """k -> (mean over prompts of the expected best of k images, its 95% CI half-width),
        for k = 2, 4, 8, .. and N itself; empty for one image per prompt."""
        n = self.images_per_prompt
        if n == 1:
            return {}
        ks = sorted({2**i for i in range(1, n.bit_length())} | {n})
        per_prompt = self.rewards.reshape(-1, n).numpy()
        return {k: mean_ci95(best_of_k(per_prompt, k)) for k in ks}

    def metrics(self) -> dict:
        return {
            "reward_mean": self.reward_mean,
            "reward_ci95": self.reward_ci95,
            "n": self.n,
            "sampling_seconds": self.sampling_seconds,
            **self.attributes,
            **{f"best_of_{k}": {"mean": m, "ci95": c} for k, (m, c) in self.best_of().items()},
        }


@torch.no_grad()
def evaluate_policy(
    policy,
    prompts: list[str],
    *,
    reward: str | Reward = "shapes",
    num_steps: int | None = None,
    shift: float | None = None,
    sampler: str = "ode",
    eta: float = 0.0,
    cfg_scale: float | None = None,
    seed: int = 0,
    images_per_prompt: int = 1,
    batch_size: int = 64,
    hybrid_base=None,
    hybrid_steps: int = 0,
    progress: bool = False,
) -> EvalResult:
    """Sample `images_per_prompt` images per prompt with `chunk_grpo.rollout.generate` and score
    them. num_steps/shift default to the model's sampling defaults; the same seed gives the same
    images."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    if images_per_prompt < 1:
        raise ValueError(f"images_per_prompt must be >= 1, got {images_per_prompt}")
    scorer = build_reward(reward) if isinstance(reward, str) else reward
    defaults = getattr(policy, "defaults", None)
    num_steps = num_steps if num_steps is not None else getattr(defaults, "num_steps", 16)
    shift = shift if shift is not None else getattr(defaults, "shift", 3.0)
    all_prompts = [p for p in prompts for _ in range(images_per_prompt)]
    generator = torch.Generator(device="cpu").manual_seed(seed)
    start = time.perf_counter()
    images = generate(
        policy,
        all_prompts,
        num_steps=num_steps,
        shift=shift,
        sampler=sampler,
        eta=eta,
        cfg_scale=cfg_scale,
        generator=generator,
        batch_size=batch_size,
        hybrid_base=hybrid_base,
        hybrid_steps=hybrid_steps,
        progress=progress,
    ).cpu()
    seconds = time.perf_counter() - start
    attributes: dict[str, float] = {}
    if hasattr(scorer, "details"):
        details = scorer.details(images, all_prompts)
        rewards = details.pop("score")
        for key, values in details.items():
            finite = values[~torch.isnan(values)]
            attributes[key] = float(finite.mean()) if finite.numel() else math.nan
    else:
        rewards = scorer(images, all_prompts)
    rewards = rewards.float().cpu()
    mean, ci = mean_ci95(rewards)
    return EvalResult(mean, ci, len(all_prompts), rewards, all_prompts, images, attributes, seconds,
                      images_per_prompt)


def captioned_grid(
    images: torch.Tensor, captions: list[str], *, columns: int = 8, cell: int = 128
) -> Image.Image:
    """One PIL image: each image scaled to `cell` pixels with its caption underneath."""
    if len(captions) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(captions)} captions")
    font = ImageFont.load_default()
    chars_per_line = max(8, cell // 6)
    wrapped = [textwrap.wrap(c, chars_per_line) or [""] for c in captions]
    line_height = 11
    text_height = line_height * max(len(lines) for lines in wrapped) + 4
    rows = math.ceil(len(captions) / columns)
    cols = min(columns, len(captions))
    sheet = Image.new("RGB", (cols * cell, rows * (cell + text_height)), "white")
    draw = ImageDraw.Draw(sheet)
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for i, (image, lines) in enumerate(zip(pixels, wrapped, strict=True)):
        x, y = (i % columns) * cell, (i // columns) * (cell + text_height)
        sheet.paste(Image.fromarray(image).resize((cell, cell), Image.NEAREST), (x, y))
        for j, line in enumerate(lines):
            draw.text((x + 2, y + cell + 2 + j * line_height), line, fill="black", font=font)
    return sheet


def write_outputs(result: EvalResult, out_dir: str | Path, settings: dict, grid_max: int = 64,
                  extra: dict | None = None):
    """metrics.json (with ``extra`` entries), samples.jsonl and grid.png (the first
    `grid_max` images) in out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics = {**result.metrics(), **(extra or {}), "settings": settings}
    # NaN (e.g. a CI from one image) is not JSON: write null.
    clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}
    (out / "metrics.json").write_text(json.dumps(clean, indent=2) + "\n")
    with open(out / "samples.jsonl", "w", encoding="utf-8") as f:
        for prompt, value in zip(result.prompts, result.rewards.tolist(), strict=True):
            f.write(json.dumps({"prompt": prompt, "reward": round(value, SAMPLE_DECIMALS)}) + "\n")
    k = min(grid_max, result.n)
    scores = result.rewards[:k].tolist()
    captions = [f"{r:.2f}  {p}" for p, r in zip(result.prompts[:k], scores, strict=True)]
    captioned_grid(result.images[:k], captions).save(out / "grid.png")


def _parser() -> argparse.ArgumentParser:
    from chunk_grpo.models import EMBEDDED_MODEL

    p = argparse.ArgumentParser(
        prog="python -m chunk_grpo.evaluate",
        description="Sample images for a prompt set and score them with a reward.",
    )
    p.add_argument("--model", default=str(EMBEDDED_MODEL), help="diffusers FLUX dir or hub id")
    p.add_argument("--prompts", default=str(HELDOUT_PROMPTS_FILE), help="text file, one a line")
    p.add_argument("--out", default="runs/evaluate", help="output directory")
    p.add_argument("--reward", default="shapes")
    p.add_argument("--steps", type=int, default=None, help="sampling steps (model default)")
    p.add_argument("--shift", type=float, default=None, help="sigma shift (model default)")
    p.add_argument("--sampler", default="ode", choices=("ode", *SDE_KINDS))
    p.add_argument("--eta", type=float, default=0.0, help="noise level of an SDE sampler")
    p.add_argument("--cfg-scale", type=float, default=None, help="CFG scale (model default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--images-per-prompt", type=int, default=1)
    p.add_argument("--max-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hybrid-base", default=None, help="base model for the last steps")
    p.add_argument("--hybrid-steps", type=int, default=0, help="first K steps use --model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--compare", default=None, metavar="EVAL_DIR",
                   help="an earlier evaluation's --out (same prompts and seed): report the "
                        "paired per-image reward difference with its 95%% CI")
    return p


def main(argv: list[str] | None = None) -> EvalResult:
    from chunk_grpo.models import FluxPolicy

    args = _parser().parse_args(argv)
    if args.hybrid_steps and args.hybrid_base is None:
        raise SystemExit("--hybrid-steps needs --hybrid-base (the base model for the rest)")
    scorer = build_reward(args.reward)  # first: a misspelt reward fails before the model loads
    prompts = load_prompts(args.prompts)
    if args.max_prompts is not None:
        if args.max_prompts < 1:
            raise SystemExit(f"--max-prompts must be >= 1, got {args.max_prompts}")
        prompts = prompts[: args.max_prompts]
    policy = FluxPolicy.from_pretrained(args.model, device=args.device)
    base = None
    if args.hybrid_base is not None:
        base = FluxPolicy.from_pretrained(args.hybrid_base, device=args.device)
    result = evaluate_policy(
        policy,
        prompts,
        reward=scorer,
        num_steps=args.steps,
        shift=args.shift,
        sampler=args.sampler,
        eta=args.eta,
        cfg_scale=args.cfg_scale,
        seed=args.seed,
        images_per_prompt=args.images_per_prompt,
        batch_size=args.batch_size,
        hybrid_base=base,
        hybrid_steps=args.hybrid_steps,
        progress=not args.quiet,
    )
    settings = {k: v for k, v in vars(args).items()
                if k not in ("out", "steps", "compare", "quiet")}
    settings.update(
        num_steps=args.steps if args.steps is not None else policy.defaults.num_steps,
        shift=args.shift if args.shift is not None else policy.defaults.shift,
        cfg_scale=args.cfg_scale if args.cfg_scale is not None else policy.default_cfg_scale,
    )
    extra = {}
    if args.compare is not None:
        try:
            paired = paired_difference(result.prompts, result.rewards.numpy(), settings,
                                       args.compare)
        except ValueError as err:
            raise SystemExit(f"--compare: {err}") from None
        extra["paired"] = paired.as_dict()
    write_outputs(result, args.out, settings, extra=extra)
    print(
        f"{args.reward} reward: {result.reward_mean:.4f} +- {result.reward_ci95:.4f} "
        f"(95% CI, n={result.n})"
    )
    for key, value in result.attributes.items():
        print(f"  {key}: {value:.4f}")
    for k, (mean, ci) in result.best_of().items():
        print(f"  best of {k} per prompt: {mean:.4f} +- {ci:.4f}")
    if "paired" in extra:
        d = extra["paired"]
        print(f"  minus {d['baseline']}: {d['diff_mean']:+.4f} +- {d['diff_ci95']:.4f} "
              f"(paired 95% CI; {d['changed_fraction']:.0%} of images changed)")
    print(f"sampling: {result.sampling_seconds:.1f} s for {result.n} images")
    print(f"wrote {Path(args.out) / 'metrics.json'} and {Path(args.out) / 'grid.png'}")
    return result


if __name__ == "__main__":
    from chunk_grpo.config import run_cli

    run_cli(main, "chunk_grpo.evaluate")
