"""Where the reward is decided: the reward spread one stochastic step causes, step by step.

    chunk-grpo credit [--model PATH] [--num-steps 10] [--prompts 8] [--group-size 8]

For each step k, every group (G images of one prompt from one shared initial noise) is sampled
with the ODE everywhere except one SDE step at k; the mean within-group reward std then says how
much of the reward is still open at step k. A step whose branches all score alike gives the
policy gradient nothing to learn from (its advantages are noise), which is how to choose
`--sde-window`: train the steps where the spread is. Saves DIR/credit.json. The measurement
itself is library code: `chunk_grpo.algorithm.dynamics.reward_spread_by_step`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from chunk_grpo.config.cli_args import (
    EMBEDDED_MODEL_DIR,
    OneLineArgumentParser,
    add_size,
    add_verbose,
    at_least_two,
    check_writable_dir,
    positive_float,
    positive_int,
)
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.sampling_options import SDE_KINDS

PROG = "python -m chunk_grpo.credit"


def credit_parser(prog: str = PROG, description: str | None = None) -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog=prog, description=description, allow_abbrev=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(EMBEDDED_MODEL_DIR))
    p.add_argument("--reward", default="shapes")
    p.add_argument("--prompts-file", default="shapes:rl", help="prompt set (as --train-prompts)")
    p.add_argument("--prompts", type=positive_int, default=8, help="number of prompts")
    p.add_argument("--group-size", type=at_least_two, default=8)
    p.add_argument("--num-steps", type=at_least_two, default=10)
    p.add_argument("--shift", type=positive_float, default=3.0)
    p.add_argument("--kind", default="flow", choices=SDE_KINDS)
    p.add_argument("--eta", type=positive_float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="credit")
    add_size(p)
    add_verbose(p)
    return p


def main(argv: list[str] | None = None, prog: str = PROG) -> dict[str, list[float]]:
    args = credit_parser(prog, __doc__).parse_args(argv)
    # torch, diffusers and the rewards: only once the flags are good
    from chunk_grpo.algorithm.dynamics import reward_spread_by_step
    from chunk_grpo.data.prompts import load_prompts
    from chunk_grpo.models import FluxPolicy
    from chunk_grpo.models.sampling_defaults import apply_sampling_size
    from chunk_grpo.rewards import get_reward

    reward = get_reward(args.reward)  # first: a misspelt reward fails before the model loads
    check_writable_dir(args.out, "--out")
    prompts = load_prompts(args.prompts_file)[:args.prompts]
    policy = FluxPolicy.from_pretrained(args.model)
    try:
        apply_sampling_size(policy, args.height, args.width, source=args.model,
                            found_file=policy.sampling_file_found)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    result = reward_spread_by_step(
        policy, prompts, reward, num_steps=args.num_steps, shift=args.shift,
        kind=args.kind, eta=args.eta, group_size=args.group_size, seed=args.seed)
    print("step  sigma   within-group reward std   mean reward")
    for k, (s, spread, r) in enumerate(zip(result["sigma"], result["spread"], result["reward"],
                                          strict=True)):
        print(f"{k:4d}  {s:.4f}  {spread:.4f}                    {r:.4f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("verbose", "height", "width")}
    (out / "credit.json").write_text(json.dumps({**result, "settings": settings}, indent=2))
    print(f"saved {out / 'credit.json'}")
    return result
