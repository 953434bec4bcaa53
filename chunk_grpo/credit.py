"""Where the reward is decided: the reward spread one stochastic step causes, step by step.

    python -m chunk_grpo.credit [--model PATH] [--num-steps 10] [--prompts 8] [--group-size 8]

For each step k, every group (G images of one prompt from one shared initial noise) is sampled
with the ODE everywhere except one SDE step at k; the mean within-group reward std then says how
much of the reward is still open at step k. A step whose branches all score alike gives the
policy gradient nothing to learn from (its advantages are noise), which is how to choose
`--sde-window`: train the steps where the spread is. Saves DIR/credit.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from chunk_grpo.cli_args import credit_parser
from chunk_grpo.config import ConfigError
from chunk_grpo.rollout import denoise
from chunk_grpo.schedule import flux_sigmas


@torch.no_grad()
def reward_spread_by_step(policy, prompts: list[str], reward, *, num_steps: int, shift: float,
                          kind: str = "flow", eta: float = 0.7, group_size: int = 8,
                          cfg_scale: float | None = None, seed: int = 0,
                          mixed_precision: str = "no") -> dict[str, list[float]]:
    """Per trained step k (0 .. T-2): mean within-group reward std and mean reward when only
    step k is stochastic. Returns {"sigma": [...], "spread": [...], "reward": [...]}."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 to measure a spread, got {group_size}")
    cfg = policy.default_cfg_scale if cfg_scale is None else cfg_scale
    sigmas = flux_sigmas(num_steps, shift)
    generator = torch.Generator().manual_seed(seed)
    rows = torch.arange(len(prompts)).repeat_interleave(group_size)
    embeds = policy.encode_prompts(list(prompts))
    row_prompts = [prompts[i] for i in rows.tolist()]
    start = policy.initial_noise(len(prompts), generator).float()
    # The ODE steps before the branch are the same for every k: run the trajectory once.
    _, ode_path, _, _ = denoise([policy, policy], start, [embeds, embeds], sigmas, num_steps,
                                sampler="ode", eta=0.0, cfg_scale=cfg, generator=None,
                                mixed_precision=mixed_precision, keep=True)
    ode_path = ode_path.repeat_interleave(group_size, 0)
    group_embeds = [embeds.index(rows)] * 2
    out = {"sigma": [], "spread": [], "reward": []}
    for k in range(num_steps - 1):
        # From x_k: one SDE step (a window of 1 on the schedule's tail), then the ODE.
        x, _, _, _ = denoise([policy, policy], ode_path[:, k], group_embeds, sigmas[k:],
                             num_steps - k, sampler=kind, eta=eta, cfg_scale=cfg,
                             generator=generator, mixed_precision=mixed_precision,
                             sde_window=1, sigma_max=float(sigmas[1]))
        scores = reward(policy.decode(x).float(), row_prompts).float().view(-1, group_size)
        out["sigma"].append(float(sigmas[k]))
        out["spread"].append(float(scores.std(dim=1).mean()))
        out["reward"].append(float(scores.mean()))
    return out


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    from chunk_grpo.evaluate import _check_out
    from chunk_grpo.models import FluxPolicy
    from chunk_grpo.models.sampling_defaults import apply_sampling_size
    from chunk_grpo.prompts import load_prompts
    from chunk_grpo.rewards import get_reward

    args = credit_parser(__doc__).parse_args(argv)
    reward = get_reward(args.reward)  # first: a misspelt reward fails before the model loads
    _check_out(args.out)
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
    from chunk_grpo.cli import run_cli

    run_cli(main, "chunk_grpo.credit")
