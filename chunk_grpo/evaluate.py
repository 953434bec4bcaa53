"""Evaluate a model: sample images for a prompt set, score them, report the mean with a 95% CI.

    python -m chunk_grpo.evaluate --model PATH --prompts FILE --out DIR

Defaults: the embedded tiny model and the held-out shapes prompts. Writes DIR/metrics.json
(reward_mean, reward_ci95, n, per-attribute means when the reward has `details`, the settings),
DIR/samples.jsonl (prompt and reward of every image) and DIR/grid.png (images captioned with
their prompts and rewards). With --images-per-prompt N > 1 it also reports best-of-k for k = 2, 4,
.., N: the mean over prompts of the best of k images, the headroom that selecting among samples
offers (GRPO's group-relative update pushes the policy towards its best-of-G).
The evaluation itself (`evaluate_policy`, `EvalResult`) is library code in
`chunk_grpo.evaluation`, which the trainer's periodic evaluation uses too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from chunk_grpo.cli import run_cli
from chunk_grpo.cli_args import check_writable_dir, evaluate_parser
from chunk_grpo.config import ConfigError
from chunk_grpo.evaluation import EvalResult, evaluate_policy
from chunk_grpo.memory_bounds import check_evaluate_memory
from chunk_grpo.metrics import reward_captions, save_image_grid
from chunk_grpo.models import FluxPolicy
from chunk_grpo.models.sampling_defaults import apply_sampling_size
from chunk_grpo.paired import SAMPLE_DECIMALS, paired_difference
from chunk_grpo.prompts import PromptSet, check_prompts, load_prompt_set
from chunk_grpo.rewards import build_reward, get_reward
from chunk_grpo.sampling_options import resolve_cfg_scale


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
    save_image_grid(result.images[:k], out / "grid.png",
                    reward_captions(result.prompts[:k], result.rewards[:k]))


def main(argv: list[str] | None = None) -> EvalResult:

    args = evaluate_parser().parse_args(argv)
    if args.hybrid_steps and args.hybrid_base is None:
        raise ConfigError("--hybrid-steps needs --hybrid-base (the base model for the rest)")
    scorer = build_reward(args.reward)  # first: a misspelt reward fails before the model loads
    check_writable_dir(args.out, "--out")
    prompt_set = load_prompt_set(args.prompts)
    if args.max_prompts is not None:
        prompt_set = PromptSet(prompt_set.source, prompt_set.prompts[: args.max_prompts],
                               prompt_set.places[: args.max_prompts])
    prompts = prompt_set.prompts
    if args.compare is not None and not (Path(args.compare) / "samples.jsonl").is_file():
        raise ConfigError(f"--compare {args.compare}: no samples.jsonl there; give the --out "
                          "directory of an earlier evaluation")
    if args.device == "cpu":  # before the weights: an evaluation that cannot fit is refused
        check_evaluate_memory(args.model, height=args.height, width=args.width,
                              images=len(prompts) * args.images_per_prompt,
                              batch_size=args.batch_size, hybrid_base=args.hybrid_base is not None)
    policy = FluxPolicy.from_pretrained(args.model, device=args.device)
    try:
        apply_sampling_size(policy, args.height, args.width, source=args.model,
                            found_file=policy.sampling_file_found)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    steps = args.steps if args.steps is not None else policy.defaults.num_steps
    if args.hybrid_steps > steps:
        raise ConfigError(f"--hybrid-steps {args.hybrid_steps} exceeds the {steps} sampling "
                          f"steps; give at most {steps}")
    for note in check_prompts(prompt_set, policy, scorer):  # before sampling, not at scoring
        print(f"note: {note}")
    base = None
    if args.hybrid_base is not None:
        base = FluxPolicy.from_pretrained(args.hybrid_base, device=args.device)
        base.height, base.width = policy.height, policy.width
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
        # On shapes prompts, the shapes world's checks beside whatever reward scores.
        guard=get_reward("shapes") if args.prompts.startswith("shapes:") else None,
    )
    settings = {k: v for k, v in vars(args).items()
                if k not in ("out", "steps", "compare", "quiet", "verbose", "height", "width")}
    settings.update(
        num_steps=args.steps if args.steps is not None else policy.defaults.num_steps,
        shift=args.shift if args.shift is not None else policy.defaults.shift,
        cfg_scale=resolve_cfg_scale(policy, args.cfg_scale),
    )
    extra = {}
    if args.compare is not None:
        try:
            paired = paired_difference(result.prompts, result.rewards.numpy(), settings,
                                       args.compare)
        except ValueError as err:
            raise ConfigError(f"--compare: {err}") from None
        extra["paired"] = paired.as_dict()
    try:
        write_outputs(result, args.out, settings, extra=extra)
    except OSError as err:
        raise ConfigError(f"cannot write to --out {args.out}: {err.strerror or err}; choose a "
                          "writable directory") from None
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
    run_cli(main, "chunk_grpo.evaluate")
