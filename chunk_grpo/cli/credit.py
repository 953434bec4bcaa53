"""Where the reward is decided: the reward spread one stochastic step causes, step by step.

    chunk-grpo credit [--config YAML] [--section.key VALUE ...] [--prompts 8] [--out DIR]

It measures what the training config would sample (the flags and --config of chunk-grpo train):
for each step k, every group (sampling.group_size images of one of the first --prompts prompts
of data.train_prompts, from one shared initial noise) is sampled with the ODE everywhere except
one step of the config's SDE (sampling.sde, sampling.eta) at k; the mean within-group reward std
then says how much of the reward is still open at step k. A step whose branches all score alike
gives the policy gradient nothing to learn from (its advantages are noise), which is how to choose
sampling.sde_window: train the steps where the spread is. Saves DIR/credit.json. The measurement
itself is library code: `chunk_grpo.algorithm.dynamics.reward_spread_by_step`.
"""

from __future__ import annotations

import json
from pathlib import Path

from chunk_grpo.config.cli_args import add_verbose, check_writable_dir, positive_int
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import ConfigArgumentParser
from chunk_grpo.config.schema import TrainConfig

PROG = "python -m chunk_grpo.credit"

# The flags of earlier versions, for the error that names the key each became.
RENAMED = {"prompts_file": "data.train_prompts", "kind": "sampling.sde",
           "num_steps": "sampling.steps"}


def credit_parser(prog: str = PROG) -> ConfigArgumentParser:
    p = ConfigArgumentParser(
        TrainConfig, prog, __doc__.strip(),
        "%(prog)s [--config YAML] [--section.key VALUE ...] [--prompts N] [--out DIR]",
        renamed=RENAMED)
    p.add_argument("--config", metavar="YAML",
                   help="a training config whose sampling is measured, e.g. configs/x.yaml")
    p.add_argument("--prompts", type=positive_int, default=8, metavar="N",
                   help="use the first N prompts of data.train_prompts")
    p.add_argument("--out", metavar="DIR", default="credit", help="output directory (credit.json)")
    add_verbose(p)
    return p


def main(argv: list[str] | None = None, prog: str = PROG) -> dict[str, list[float]]:
    own, cfg = credit_parser(prog).parse_config(argv)
    if cfg.sampling.group_size < 2:
        raise ConfigError(f"sampling.group_size must be >= 2 to measure a spread within a group, "
                          f"got {cfg.sampling.group_size}")
    # torch, diffusers and the rewards: only once the flags are good
    from chunk_grpo.algorithm.dynamics import reward_spread_by_step
    from chunk_grpo.config.cli_args import resolve_device
    from chunk_grpo.data.prompts import load_prompts
    from chunk_grpo.runtime.precision import resolve_mixed_precision
    from chunk_grpo.train.setup import load_policy, resolve_reward, sampling_shift

    device = resolve_device(cfg.run.device)
    reward = resolve_reward(cfg, device)  # first: a misspelt reward fails before the model loads
    check_writable_dir(own["out"], "--out")
    prompts = load_prompts(cfg.data.train_prompts)[:own["prompts"]]
    policy = load_policy(cfg, device)
    s, shift = cfg.sampling, sampling_shift(cfg, policy)
    precision = resolve_mixed_precision(cfg.model.mixed_precision, device).mode
    result = reward_spread_by_step(
        policy, prompts, reward, num_steps=s.steps, shift=shift, kind=s.sde, eta=s.eta,
        group_size=s.group_size, cfg_scale=s.cfg_scale, seed=cfg.run.seed,
        mixed_precision=precision)
    print("step  sigma   within-group reward std   mean reward")
    for k, (sigma, spread, r) in enumerate(zip(result["sigma"], result["spread"],
                                               result["reward"], strict=True)):
        print(f"{k:4d}  {sigma:.4f}  {spread:.4f}                    {r:.4f}")
    out = Path(own["out"])
    out.mkdir(parents=True, exist_ok=True)
    settings = {"model.name": cfg.model.name, "reward.name": cfg.reward.name,
                "data.train_prompts": cfg.data.train_prompts, "prompts": len(prompts),
                "sampling.steps": s.steps, "sampling.shift": shift, "sampling.sde": s.sde,
                "sampling.eta": s.eta, "sampling.group_size": s.group_size,
                "sampling.cfg_scale": s.cfg_scale, "run.seed": cfg.run.seed}
    (out / "credit.json").write_text(json.dumps({**result, "settings": settings}, indent=2))
    print(f"saved {out / 'credit.json'}")
    return result
