"""`chunk-grpo gradient-snr` (``python -m chunk_grpo.gradient_snr``): the policy-gradient
signal-to-noise ratio of a training config; the measurement is `chunk_grpo.analysis.gradient_snr`.
"""

from __future__ import annotations

import json
from pathlib import Path

from chunk_grpo.config.cli_args import OneLineArgumentParser, nonnegative_int
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config, parse_args

PROG = "python -m chunk_grpo.gradient_snr"


def gradient_snr_parser(prog: str = PROG) -> OneLineArgumentParser:
    p = OneLineArgumentParser(
        prog=prog, allow_abbrev=False,
        description="Policy-gradient signal-to-noise ratio of a training config: K independent "
                    "iterations at the same weights. Other flags are those of chunk_grpo.train.")
    p.add_argument("--iterations", type=int, default=16,
                   help="independent iterations K (>= 3; default 16)")
    p.add_argument("--first-step", type=nonnegative_int, default=0,
                   help="iteration index of the first one (selects prompts and noise)")
    p.add_argument("--per-chunk", action="store_true",
                   help="also measure each chunk's own gradient (trains every chunk)")
    p.add_argument("--json", metavar="FILE", help="also write the statistics here")
    return p


def main(argv: list[str] | None = None, prog: str = PROG) -> None:
    parser = gradient_snr_parser(prog)
    args, rest = parser.parse_known_args(argv)
    yaml_path, overrides, resume = parse_args(rest, prog=parser.prog)
    if resume:
        raise ConfigError("gradient_snr measures a config; --resume is not supported")
    cfg = build_config(yaml_path, overrides)
    from chunk_grpo.analysis.gradient_snr import measure, summary  # torch: once the config is good

    stats = measure(cfg, args.iterations, args.first_step, progress=cfg.run.progress,
                    per_chunk=args.per_chunk)
    print(summary(stats), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(stats, indent=2) + "\n")
