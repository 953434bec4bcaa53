"""The temporal-dynamics profile: how fast latents change at each step, and chunks from it.

    chunk-grpo profile [--config YAML] [--section.key VALUE ...] [--out DIR]

It profiles what the training config would (the flags and --config of chunk-grpo train): the
first chunks.profile_prompts prompts of data.train_prompts, sampled with the ODE in
sampling.steps steps, and prints L1rel(t) = mean|x_{t+1} - x_t| / (mean|x_t| + 1e-8) per
transition, the chunks "auto" would split the trained transitions into (at most chunks.max_size
steps each), and saves DIR/profile.json and DIR/profile.png. The measurement itself is library
code: `chunk_grpo.algorithm.dynamics`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from chunk_grpo.config.cli_args import add_verbose, check_writable_dir
from chunk_grpo.config.parsing import ConfigArgumentParser
from chunk_grpo.config.schema import TrainConfig

if TYPE_CHECKING:
    from chunk_grpo.algorithm.chunking import ChunkLayout

PROG = "python -m chunk_grpo.profile"

# The flags of earlier versions, for the error that names the key each became.
RENAMED = {"prompts_file": "data.train_prompts", "prompts": "chunks.profile_prompts",
           "num_steps": "sampling.steps", "max_chunk_size": "chunks.max_size"}


def profile_parser(prog: str = PROG) -> ConfigArgumentParser:
    p = ConfigArgumentParser(
        TrainConfig, prog, __doc__.strip(),
        "%(prog)s [--config YAML] [--section.key VALUE ...] [--out DIR]", renamed=RENAMED)
    p.add_argument("--config", metavar="YAML",
                   help="a training config whose chunks are profiled, e.g. configs/x.yaml")
    p.add_argument("--out", metavar="DIR", default="profile",
                   help="output directory (profile.json, profile.png)")
    add_verbose(p)
    return p


def main(argv: list[str] | None = None, prog: str = PROG) -> ChunkLayout:
    own, cfg = profile_parser(prog).parse_config(argv)
    # torch and diffusers: only once the flags are good
    from chunk_grpo.algorithm.dynamics import measure_dynamics, propose_chunks
    from chunk_grpo.algorithm.sigmas import flux_sigmas
    from chunk_grpo.config.cli_args import resolve_device
    from chunk_grpo.data.prompts import load_prompts
    from chunk_grpo.runtime.precision import resolve_mixed_precision
    from chunk_grpo.train.plots import save_profile
    from chunk_grpo.train.setup import dynamics_settings, load_policy

    device = resolve_device(cfg.run.device)
    check_writable_dir(own["out"], "--out")
    prompts = load_prompts(cfg.data.train_prompts)[:cfg.chunks.profile_prompts]
    policy = load_policy(cfg, device)
    settings = dynamics_settings(
        cfg, policy, resolve_mixed_precision(cfg.model.mixed_precision, device).mode)
    curve = measure_dynamics(policy, prompts, **settings)
    layout = propose_chunks(curve, cfg.chunks.max_size, cfg.num_trained)
    print("step  sigma    L1rel")
    sigmas = flux_sigmas(settings["num_steps"], settings["shift"])
    for t, v in enumerate(curve.tolist()):
        mark = "  (not trained)" if t >= cfg.num_trained else ""
        print(f"{t:4d}  {float(sigmas[t]):.4f}  {v:.5f}{mark}")
    print(f"proposed chunks: {','.join(str(s) for s in layout.sizes)} (of the "
          f"{cfg.num_trained} trained transitions)")
    if cfg.sampling.algorithm == "g2rpo" or cfg.chunks.spec != "auto" or cfg.chunks.size:
        print("note: this config does not use auto chunks (chunks.spec, chunks.size or "
              "sampling.algorithm g2rpo fix the layout); training uses its own layout")
    save_profile(curve, layout, own["out"])
    print(f"saved {Path(own['out']) / 'profile.json'} and {Path(own['out']) / 'profile.png'}")
    return layout
