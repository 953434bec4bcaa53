"""Where the reward is decided: the reward spread one stochastic step causes, step by step.

    python -m chunk_grpo.credit [--model PATH] [--num-steps 10] [--prompts 8] [--group-size 8]

For each step k, every group (G images of one prompt from one shared initial noise) is sampled
with the ODE everywhere except one SDE step at k; the mean within-group reward std then says how
much of the reward is still open at step k. A step whose branches all score alike gives the
policy gradient nothing to learn from (its advantages are noise), which is how to choose
`--sde-window`: train the steps where the spread is. Saves DIR/credit.json. The measurement
itself is library code: `chunk_grpo.dynamics.reward_spread_by_step`.
"""

from __future__ import annotations

import json
from pathlib import Path

from chunk_grpo.cli import run_cli
from chunk_grpo.cli_args import check_writable_dir, credit_parser
from chunk_grpo.config import ConfigError
from chunk_grpo.dynamics import reward_spread_by_step
from chunk_grpo.models import FluxPolicy
from chunk_grpo.models.sampling_defaults import apply_sampling_size
from chunk_grpo.prompts import load_prompts
from chunk_grpo.rewards import get_reward


def main(argv: list[str] | None = None) -> dict[str, list[float]]:

    args = credit_parser(__doc__).parse_args(argv)
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


if __name__ == "__main__":
    run_cli(main, "chunk_grpo.credit")
