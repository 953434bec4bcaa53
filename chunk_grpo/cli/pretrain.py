"""Pretrain the embedded tiny FLUX on the shapes world: `chunk-grpo pretrain --out DIR`.

Two stages, deterministic from `--seed` (for a fixed thread count):
1. VAE: the AutoencoderKL learns to reconstruct rendered scenes (MSE + a small KL term). Its
   latents' mean and std then set `shift_factor` / `scaling_factor`, as FLUX's VAE config does.
2. Transformer: rectified flow on the normalised latents. x_s = (1 - s) x0 + s noise, target
   velocity noise - x0, with s = shift(u), u ~ U(0, 1), the sigmas the sampler visits. Captions
   are dropped to the empty prompt with probability `--caption-dropout` so that classifier-free
   guidance (`true_cfg_scale` in FluxPipeline, `cfg_scale` in FluxPolicy) works.

The text encoders stay frozen at their random initialisation: the transformer learns to read their
outputs (word-level T5 tokens keep every word distinct). The learning rate is constant after
warmup and the EMA of the weights is what gets saved, so the checkpoint after k steps of a long run
equals the result of `--steps k`. The training itself is `chunk_grpo.pretrain.flux`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from chunk_grpo.config.cli_args import (
    OneLineArgumentParser,
    add_verbose,
    check_writable_dir,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)
from chunk_grpo.config.errors import ConfigError

PROG = "python -m chunk_grpo.pretrain"


def pretrain_parser(prog: str = PROG, description: str | None = None) -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog=prog, description=description,
                              allow_abbrev=False, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output diffusers directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-images", type=positive_int, default=20000,
                   help="rendered training scenes")
    p.add_argument("--vae-steps", type=positive_int, default=400)
    p.add_argument("--vae-batch-size", type=positive_int, default=16)
    p.add_argument("--vae-lr", type=positive_float, default=1e-3)
    p.add_argument("--steps", type=positive_int, default=1500, help="transformer optimizer steps")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--warmup-steps", type=nonnegative_int, default=100)
    p.add_argument("--ema-decay", type=nonnegative_float, default=0.995)
    p.add_argument("--caption-dropout", type=nonnegative_float, default=0.1)
    p.add_argument("--shift", type=positive_float, default=3.0,
                   help="sigma shift (training and sampling)")
    p.add_argument("--cfg-scale", type=nonnegative_float, default=3.0,
                   help="recorded default CFG scale")
    p.add_argument("--checkpoint-every", type=nonnegative_int, default=0,
                   help="also save every k steps")
    p.add_argument("--threads", type=positive_int, default=2)
    add_verbose(p)
    return p


def parse_args(argv: list[str] | None = None, prog: str = PROG) -> argparse.Namespace:
    args = pretrain_parser(prog, __doc__).parse_args(argv)
    if not 0.0 <= args.caption_dropout < 1.0:
        raise ConfigError("--caption-dropout must be in [0, 1)")
    if not 0.0 <= args.ema_decay < 1.0:
        raise ConfigError("--ema-decay must be in [0, 1)")
    try:
        check_writable_dir(args.out, "--out")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return args


def main(argv: list[str] | None = None, prog: str = PROG) -> None:
    args = parse_args(argv, prog)
    # Idle OpenMP threads must sleep, not spin: set before torch starts its thread pool.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from chunk_grpo.pretrain.flux import run

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        run(args)
    finally:
        torch.set_num_threads(threads)
