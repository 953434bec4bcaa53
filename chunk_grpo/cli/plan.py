"""``chunk-grpo plan`` (``python -m chunk_grpo.plan``): the memory plan of a training config,
before any GPU is touched.

    chunk-grpo plan --config configs/flux_dev_hpsv3.yaml --gpus 8 --gpu-memory 80

Prints the parts of the run and the peak of each phase (load, prompt caching, temporal
profile, rollout, reward, training, evaluation, checkpoint save, export) per GPU and per host
(`chunk_grpo.plan.memory`), "fits" or "does not fit" with the peak phase and the margin, and the
levers that would cut the peak, by effect. Every flag of ``chunk-grpo train`` overrides the
config (``--model.name DIR``, ``--model.lora_rank 64``, ``--parallel.mode fsdp``, ...).
``--json FILE`` writes the numbers, the phases among them. ``--gpus-per-node N`` sets the ranks
a host holds.
Exit status: 0 when the plan fits, 1 when it does not, 2 for a bad flag or config.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from chunk_grpo.config.cli_args import (
    OneLineArgumentParser,
    nonnegative_float,
    positive_float,
    positive_int,
)
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config, parse_args

if TYPE_CHECKING:
    from chunk_grpo.plan.memory import Plan

PROG = "python -m chunk_grpo.plan"


def plan_parser(prog: str = PROG) -> OneLineArgumentParser:
    p = OneLineArgumentParser(
        prog=prog, allow_abbrev=False,
        description="Memory plan of a training config: the peak of every phase (load, prompt "
                    "caching, profile, rollout, reward, training, evaluation, checkpoint, export) "
                    "per GPU and per host, from its parts (weights, gradients, optimizer state, "
                    "activations measured with FakeTensor, frozen models, reward), and whether "
                    "it fits. Other flags are those of "
                    "chunk_grpo.train (--config, --model.name, --model.lora_rank, ...).")
    p.add_argument("--gpus", type=positive_int, default=1, help="GPUs (world size; default 1)")
    p.add_argument("--gpu-memory", type=positive_float, default=80.0, metavar="GB",
                   help="memory per GPU in GB (default 80)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None, metavar="N",
                   help="GPUs per host, for the host memory per node (default min(gpus, 8))")
    p.add_argument("--reward-gb", type=nonnegative_float, default=None, metavar="GB",
                   help="the reward model's weights in GB, for a reward the plan does not know")
    p.add_argument("--json", metavar="FILE", help="also write the numbers here")
    return p


def main(argv: list[str] | None = None, prog: str = PROG) -> Plan:
    argv = sys.argv[1:] if argv is None else argv
    args, rest = plan_parser(prog).parse_known_args(argv)
    yaml_path, overrides, resume = parse_args(rest, prog=prog)
    if resume:
        raise ConfigError("the plan reads a config, not a run: give --config (or the run's "
                          "config.yaml as --config RUN/config.yaml)")
    cfg = build_config(yaml_path, overrides)
    from chunk_grpo.plan.memory import GB, format_plan, levers_by_effect, plan_for_config

    plan = plan_for_config(cfg, args.gpus, args.gpu_memory * GB, reward_gb=args.reward_gb,
                           gpus_per_node=args.gpus_per_node)
    print(format_plan(plan), flush=True)
    levers = levers_by_effect(plan)
    print("levers by effect: " + (", ".join(f"{label} (-{saved / GB:.1f} GB)"
                                            for label, saved in levers) or "none"), flush=True)
    if args.json:
        data = plan.to_dict()
        data["levers"] = [{"lever": label, "saves_bytes": saved} for label, saved in levers]
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    if not plan.fits:
        raise SystemExit(1)
    return plan
