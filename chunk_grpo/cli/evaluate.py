"""Evaluate a model: sample images for a prompt set, score them, report the mean with a 95% CI.

    chunk-grpo evaluate [--model.name PATH] [--data.eval_prompts FILE] [--out DIR]
                                                                (python -m chunk_grpo.evaluate)

Defaults: the embedded tiny model and the held-out shapes prompts, sampled with the ODE and the
model's own step count, shift and CFG scale. Settings are named as in the training config
(--model.name, --reward.name, --sampling.steps, --run.seed, ...), with an evaluation's defaults.
Writes DIR/metrics.json (reward_mean, reward_ci95, n, per-attribute means when the reward has
`details`, the settings), DIR/samples.jsonl (prompt and reward of every image) and DIR/grid.png
(images captioned with their prompts and rewards). With --images-per-prompt N > 1 it also reports
best-of-k for k = 2, 4, .., N: the mean over prompts of the best of k images, the headroom that
selecting among samples offers (GRPO's group-relative update pushes the policy towards its
best-of-G). The evaluation itself (`evaluate_policy`, `EvalResult`) is library code in
`chunk_grpo.evaluate.evaluation`, which the trainer's periodic evaluation uses too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from chunk_grpo.config.cli_args import add_verbose, check_writable_dir, positive_int
from chunk_grpo.config.commands import EvaluateConfig
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import ConfigArgumentParser
from chunk_grpo.config.sampling_options import resolve_cfg_scale

if TYPE_CHECKING:
    from chunk_grpo.evaluate.evaluation import EvalResult

PROG = "python -m chunk_grpo.evaluate"

# The flags of earlier versions, for the error that names the key each became.
RENAMED = {"prompts": "data.eval_prompts", "sampler": "sampling.sde", "quiet": "run.progress",
           "num_steps": "sampling.steps"}

DESCRIPTION = (
    "Sample images for a prompt set and score them with a reward; report the mean with its 95%\n"
    "CI, best-of-k, and the paired difference to an earlier evaluation (--compare).\n\n"
    "Settings are --section.key VALUE, named as in the training config, listed by section below.")


def evaluate_parser(prog: str = PROG) -> ConfigArgumentParser:
    p = ConfigArgumentParser(EvaluateConfig, prog, DESCRIPTION,
                             "%(prog)s [--section.key VALUE ...] [--out DIR] [--compare DIR]",
                             renamed=RENAMED)
    p.add_argument("--out", default="runs/evaluate", metavar="DIR", help="output directory")
    p.add_argument("--images-per-prompt", type=positive_int, default=1, metavar="N",
                   help="images per prompt (N > 1: also best-of-k)")
    p.add_argument("--max-prompts", type=positive_int, default=None, metavar="N",
                   help="use the first N prompts")
    p.add_argument("--hybrid-base", default=None, metavar="DIR",
                   help="base model for the steps after eval.hybrid_steps")
    p.add_argument("--compare", default=None, metavar="EVAL_DIR",
                   help="an earlier evaluation's --out (same prompts and seed): report the "
                        "paired per-image reward difference with its 95%% CI")
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
    args, cfg = evaluate_parser(prog).parse_config(argv)
    hybrid_steps = cfg.eval.hybrid_steps
    if hybrid_steps and args["hybrid_base"] is None:
        raise ConfigError("eval.hybrid_steps needs --hybrid-base (the base model for the rest)")
    # torch, diffusers and the rewards: only once the flags are good
    from chunk_grpo.config.cli_args import model_path, resolve_device
    from chunk_grpo.data.prompts import PromptSet, check_prompts, load_prompt_set
    from chunk_grpo.evaluate.evaluation import evaluate_policy
    from chunk_grpo.evaluate.paired import paired_difference
    from chunk_grpo.models import FluxPolicy
    from chunk_grpo.models.sampling_defaults import apply_sampling_size
    from chunk_grpo.plan.bounds import check_evaluate_memory
    from chunk_grpo.rewards import build_reward, get_reward

    model, s, out, compare = cfg.model, cfg.sampling, args["out"], args["compare"]
    device = resolve_device(cfg.run.device)
    # first: a misspelt reward fails before the model loads
    scorer = build_reward(cfg.reward.name, device=cfg.reward.device or None)
    check_writable_dir(out, "--out")
    prompt_set = load_prompt_set(cfg.data.eval_prompts)
    if args["max_prompts"] is not None:
        n = args["max_prompts"]
        prompt_set = PromptSet(prompt_set.source, prompt_set.prompts[:n], prompt_set.places[:n])
    prompts = prompt_set.prompts
    if compare is not None and not (Path(compare) / "samples.jsonl").is_file():
        raise ConfigError(f"--compare {compare}: no samples.jsonl there; give the --out "
                          "directory of an earlier evaluation")
    if device.type == "cpu":  # before the weights: an evaluation that cannot fit is refused
        check_evaluate_memory(model.name, height=model.height, width=model.width,
                              images=len(prompts) * args["images_per_prompt"],
                              batch_size=s.batch_size, hybrid_base=args["hybrid_base"] is not None)
    policy = FluxPolicy.from_pretrained(model_path(model.name), device=device)
    try:
        apply_sampling_size(policy, model.height, model.width, source=model_path(model.name),
                            found_file=policy.sampling_file_found)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    steps = s.steps if s.steps is not None else policy.defaults.num_steps
    if hybrid_steps > steps:
        raise ConfigError(f"eval.hybrid_steps {hybrid_steps} exceeds the {steps} sampling "
                          f"steps; give at most {steps}")
    for note in check_prompts(prompt_set, policy, scorer):  # before sampling, not at scoring
        print(f"note: {note}")
    base = None
    if args["hybrid_base"] is not None:
        base = FluxPolicy.from_pretrained(model_path(args["hybrid_base"]), device=device)
        base.height, base.width = policy.height, policy.width
    result = evaluate_policy(
        policy,
        prompts,
        reward=scorer,
        num_steps=s.steps,
        shift=s.shift,
        sampler=s.sde,
        eta=s.eta,
        cfg_scale=s.cfg_scale,
        seed=cfg.run.seed,
        images_per_prompt=args["images_per_prompt"],
        batch_size=s.batch_size,
        hybrid_base=base,
        hybrid_steps=hybrid_steps,
        progress=cfg.run.progress,
        # On shapes prompts, the shapes world's checks beside whatever reward scores.
        guard=get_reward("shapes") if cfg.data.eval_prompts.startswith("shapes:") else None,
    )
    settings = {
        "model.name": model.name, "reward.name": cfg.reward.name,
        "data.eval_prompts": cfg.data.eval_prompts, "sampling.steps": steps,
        "sampling.shift": s.shift if s.shift is not None else policy.defaults.shift,
        "sampling.sde": s.sde, "sampling.eta": s.eta,
        "sampling.cfg_scale": resolve_cfg_scale(policy, s.cfg_scale),
        "sampling.batch_size": s.batch_size, "run.seed": cfg.run.seed, "run.device": device.type,
        "images_per_prompt": args["images_per_prompt"], "max_prompts": args["max_prompts"],
        "hybrid_base": args["hybrid_base"], "eval.hybrid_steps": hybrid_steps,
    }
    extra = {}
    if compare is not None:
        try:
            paired = paired_difference(result.prompts, result.rewards.numpy(), settings, compare)
        except ValueError as err:
            raise ConfigError(f"--compare: {err}") from None
        extra["paired"] = paired.as_dict()
    try:
        write_outputs(result, out, settings, extra=extra)
    except OSError as err:
        raise ConfigError(f"cannot write to --out {out}: {err.strerror or err}; choose a "
                          "writable directory") from None
    print(
        f"{cfg.reward.name} reward: {result.reward_mean:.4f} +- {result.reward_ci95:.4f} "
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
    print(f"wrote {Path(out) / 'metrics.json'} and {Path(out) / 'grid.png'}")
    return result
