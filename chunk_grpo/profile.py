"""The temporal-dynamics profile: how fast latents change at each step, and chunks from it.

    python -m chunk_grpo.profile [--model PATH] [--num-steps 16] [--prompts 16] [--out DIR]

prints L1rel(t) = mean|x_{t+1} - x_t| / (mean|x_t| + 1e-8) per transition (averaged over prompts,
on the base model), the proposed chunk sizes, and saves DIR/profile.json and DIR/profile.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from chunk_grpo.chunking import ChunkLayout, relative_change, segment_by_dynamics
from chunk_grpo.cli_args import profile_parser
from chunk_grpo.config import ConfigError
from chunk_grpo.plots import line_plot
from chunk_grpo.rollout import denoise
from chunk_grpo.schedule import flux_sigmas


@torch.no_grad()
def measure_dynamics(policy, prompts: list[str], *, num_steps: int, shift: float,
                     sampler: str = "ode", eta: float = 0.0, cfg_scale: float | None = None,
                     seed: int = 0, batch_size: int = 64) -> torch.Tensor:
    """L1rel(t) for the T transitions, averaged over one trajectory per prompt. [T] float32."""
    cfg = policy.default_cfg_scale if cfg_scale is None else cfg_scale
    sigmas = flux_sigmas(num_steps, shift)
    generator = torch.Generator().manual_seed(seed)
    curves, weights = [], []
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start:start + batch_size])
        embeds = policy.encode_prompts(batch)
        x = policy.initial_noise(len(batch), generator).float()
        _, latents, _, _ = denoise([policy, policy], x, [embeds, embeds], sigmas, num_steps,
                                    sampler=sampler, eta=eta, cfg_scale=cfg,
                                    generator=generator, keep=True)
        curves.append(relative_change(latents) * len(batch))
        weights.append(len(batch))
    return torch.stack(curves).sum(0) / sum(weights)


def propose_chunks(curve: torch.Tensor, max_size: int = 5,
                   num_trained: int | None = None) -> ChunkLayout:
    """Chunks of the trained transitions: the first ``num_trained`` (default T-1: the last
    transition is never trained)."""
    w = curve.numel() - 1 if num_trained is None else num_trained
    return segment_by_dynamics(curve[:w], max_size=max_size)


def plot_profile(curve: torch.Tensor, layout: ChunkLayout, path: str | Path) -> Path:
    """The curve per step with the chunk boundaries as red vertical lines (PNG)."""
    steps = list(range(curve.numel()))
    return line_plot({"L1rel": (steps, curve.tolist())}, path,
                     title=f"temporal dynamics: L1rel(t) per sampling step; chunks "
                           f"{list(layout.sizes)}",
                     xlabel="sampling step t (0 = highest noise)",
                     ylabel="L1rel(t) = mean|x(t+1) - x(t)| / mean|x(t)|",
                     vlines=[start - 0.5 for start in layout.starts[1:]],
                     vline_label="chunk boundary")


def save_profile(curve: torch.Tensor, layout: ChunkLayout, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(
        {"l1rel": [round(v, 6) for v in curve.tolist()], "chunks": list(layout.sizes)},
        indent=2) + "\n")
    plot_profile(curve, layout, out / "profile.png")


def main(argv: list[str] | None = None) -> ChunkLayout:
    from chunk_grpo.evaluate import _check_out
    from chunk_grpo.models import FluxPolicy
    from chunk_grpo.models.sampling_defaults import apply_sampling_size
    from chunk_grpo.prompts import load_prompts

    args = profile_parser(__doc__).parse_args(argv)
    _check_out(args.out)
    prompts = load_prompts(args.prompts_file)[:args.prompts]
    policy = FluxPolicy.from_pretrained(args.model)
    try:
        apply_sampling_size(policy, args.height, args.width, source=args.model,
                            found_file=policy.sampling_file_found)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    num_steps = args.num_steps or policy.defaults.num_steps
    if num_steps < 2:
        raise ConfigError(f"--num-steps must be >= 2 (a profile compares steps), got {num_steps}")
    shift = args.shift if args.shift is not None else policy.defaults.shift
    curve = measure_dynamics(policy, prompts, num_steps=num_steps, shift=shift, seed=args.seed)
    layout = propose_chunks(curve, args.max_chunk_size)
    print("step  sigma    L1rel")
    sigmas = flux_sigmas(num_steps, shift)
    for t, v in enumerate(curve.tolist()):
        mark = "  (not trained)" if t == num_steps - 1 else ""
        print(f"{t:4d}  {float(sigmas[t]):.4f}  {v:.5f}{mark}")
    print(f"proposed chunks: {','.join(str(s) for s in layout.sizes)}")
    save_profile(curve, layout, args.out)
    print(f"saved {Path(args.out) / 'profile.json'} and {Path(args.out) / 'profile.png'}")
    return layout


if __name__ == "__main__":
    from chunk_grpo.cli import run_cli

    run_cli(main, "chunk_grpo.profile")
