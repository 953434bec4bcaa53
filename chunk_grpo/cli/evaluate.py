"""Evaluate a model: sample images for a prompt set, score them, report the mean with a 95% CI.

    chunk-grpo evaluate --model PATH --prompts FILE --out DIR    (python -m chunk_grpo.evaluate)

Defaults: the embedded tiny model and the held-out shapes prompts. Writes DIR/metrics.json
(reward_mean, reward_ci95, n, per-attribute means when the reward has `details`, the settings),
DIR/samples.jsonl (prompt and reward of every image) and DIR/grid.png (images captioned with
their prompts and rewards). With --images-per-prompt N > 1 it also reports best-of-k for k = 2, 4,
.., N: the mean over prompts of the best of k images, the headroom that selecting among samples
offers (GRPO's group-relative update pushes the policy towards its best-of-G).
The evaluation itself (`evaluate_policy`, `EvalResult`) is library code in
`chunk_grpo.evaluate.evaluation`, which the trainer's periodic evaluation uses too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from chunk_grpo.config.cli_args import (
    EMBEDDED_MODEL_DIR,
    OneLineArgumentParser,
    add_size,
    add_verbose,
    at_least_two,
    check_writable_dir,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.sampling_options import SAMPLERS, resolve_cfg_scale

if TYPE_CHECKING:
    from chunk_grpo.evaluate.evaluation import EvalResult

PROG = "python -m chunk_grpo.evaluate"


def evaluate_parser(prog: str = PROG) -> OneLineArgumentParser:
    p = OneLineArgumentParser(
        prog=prog, allow_abbrev=False,
        description="Sample images for a prompt set and score them with a reward.")
    p.add_argument("--model", default=str(EMBEDDED_MODEL_DIR), help="diffusers FLUX dir or hub id")
    p.add_argument("--prompts", default="shapes:heldout",
                   help="prompt set: .txt/.jsonl/.csv file, datasets DIR[::SPLIT], "
                        "hf:NAME:SPLIT or shapes:heldout")
    p.add_argument("--out", default="runs/evaluate", help="output directory")
    p.add_argument("--reward", default="shapes")
    p.add_argument("--steps", type=at_least_two, default=None,
                   help="sampling steps (model default)")
    p.add_argument("--shift", type=positive_float, default=None, help="sigma shift (model default)")
    p.add_argument("--sampler", default="ode", choices=SAMPLERS)
    p.add_argument("--eta", type=nonnegative_float, default=0.0,
                   help="noise level of an SDE sampler")
    p.add_argument("--cfg-scale", type=nonnegative_float, default=None,
                   help="CFG scale (model default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--images-per-prompt", type=positive_int, default=1)
    p.add_argument("--max-prompts", type=positive_int, default=None,
                   help="use the first N prompts")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--hybrid-base", default=None, help="base model for the last steps")
    p.add_argument("--hybrid-steps", type=nonnegative_int, default=0,
                   help="first K steps use --model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--compare", default=None, metavar="EVAL_DIR",
                   help="an earlier evaluation's --out (same prompts and seed): report the "
                        "paired per-image reward difference with its 95%% CI")
    add_size(p)
    add_verbose(p)
    return p


def write_outputs(result: EvalResult, out_dir: str | Path, settings: dict, grid_max: int = 64,
                  extra: dict | None = None):
    """metrics.json (with ``extra`` entries), samples.jsonl and grid.png (the first
    `grid_max` images) in out_dir."""
    from chunk_grpo.evaluate.paired import SAMPLE_DECIMALS
    from chunk_grpo.train.metrics import reward_captions, save_image_grid

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


def main(argv: list[str] | None = None, prog: str = PROG) -> EvalResult:
    args = evaluate_parser(prog).parse_args(argv)
    if args.hybrid_steps and args.hybrid_base is None:
        raise ConfigError("--hybrid-steps needs --hybrid-base (the base model for the rest)")
    # torch, diffusers and the rewards: only once the flags are good
    from chunk_grpo.data.prompts import PromptSet, check_prompts, load_prompt_set
    from chunk_grpo.evaluate.evaluation import evaluate_policy
    from chunk_grpo.evaluate.paired import paired_difference
    from chunk_grpo.models import FluxPolicy
    from chunk_grpo.models.sampling_defaults import apply_sampling_size
    from chunk_grpo.plan.bounds import check_evaluate_memory
    from chunk_grpo.rewards import build_reward, get_reward

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
