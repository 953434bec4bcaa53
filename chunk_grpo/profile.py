"""The temporal-dynamics profile: how fast latents change at each step, and chunks from it.

    python -m chunk_grpo.profile [--model PATH] [--num-steps 16] [--prompts 16] [--out DIR]

prints L1rel(t) = mean|x_{t+1} - x_t| / (mean|x_t| + 1e-8) per transition (averaged over prompts,
on the base model), the proposed chunk sizes, and saves DIR/profile.json and DIR/profile.png.
The measurement itself is library code: `chunk_grpo.dynamics`.
"""

from __future__ import annotations

from pathlib import Path

from chunk_grpo.chunking import ChunkLayout
from chunk_grpo.cli import run_cli
from chunk_grpo.cli_args import check_writable_dir, profile_parser
from chunk_grpo.config import ConfigError
from chunk_grpo.dynamics import measure_dynamics, propose_chunks, save_profile
from chunk_grpo.models import FluxPolicy
from chunk_grpo.models.sampling_defaults import apply_sampling_size
from chunk_grpo.prompts import load_prompts
from chunk_grpo.schedule import flux_sigmas


def main(argv: list[str] | None = None) -> ChunkLayout:

    args = profile_parser(__doc__).parse_args(argv)
    check_writable_dir(args.out, "--out")
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
    run_cli(main, "chunk_grpo.profile")
