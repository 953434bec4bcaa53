"""The temporal-dynamics profile: how fast latents change at each step, and chunks from it.

    chunk-grpo profile [--model PATH] [--num-steps 16] [--prompts 16] [--out DIR]

prints L1rel(t) = mean|x_{t+1} - x_t| / (mean|x_t| + 1e-8) per transition (averaged over prompts,
on the base model), the proposed chunk sizes, and saves DIR/profile.json and DIR/profile.png.
The measurement itself is library code: `chunk_grpo.algorithm.dynamics`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from chunk_grpo.algorithm.chunking import ChunkLayout

PROG = "python -m chunk_grpo.profile"


def profile_parser(prog: str = PROG, description: str | None = None) -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog=prog, description=description, allow_abbrev=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(EMBEDDED_MODEL_DIR))
    p.add_argument("--prompts-file", default="shapes:train", help="prompt set (as --train-prompts)")
    p.add_argument("--prompts", type=positive_int, default=16, help="number of prompts")
    p.add_argument("--num-steps", type=at_least_two, default=None)
    p.add_argument("--shift", type=positive_float, default=None)
    p.add_argument("--max-chunk-size", type=positive_int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="profile")
    add_size(p)
    add_verbose(p)
    return p


def main(argv: list[str] | None = None, prog: str = PROG) -> ChunkLayout:
    args = profile_parser(prog, __doc__).parse_args(argv)
    # torch and diffusers: only once the flags are good
    from chunk_grpo.algorithm.dynamics import measure_dynamics, propose_chunks
    from chunk_grpo.algorithm.sigmas import flux_sigmas
    from chunk_grpo.data.prompts import load_prompts
    from chunk_grpo.models import FluxPolicy
    from chunk_grpo.models.sampling_defaults import apply_sampling_size
    from chunk_grpo.train.plots import save_profile

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
