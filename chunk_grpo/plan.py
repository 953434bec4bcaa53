"""``python -m chunk_grpo.plan``: the memory plan of a training config, before any GPU is touched.

    python -m chunk_grpo.plan --config configs/flux_dev_hpsv3.yaml --gpus 8 --gpu-memory 80

Prints the parts of the run and the peak of each phase (load, prompt caching, temporal
profile, rollout, reward, training, evaluation, checkpoint save, export) per GPU and per host
(`chunk_grpo.memory_plan`), "fits" or "does not fit" with the peak phase and the margin, and the
levers that would cut the peak, by effect. Every flag of ``chunk_grpo.train`` overrides the
config (``--model DIR``, ``--lora-rank 64``, ``--parallelism fsdp``, ...). ``--json FILE``
writes the numbers, the phases among them. ``--gpus-per-node N`` sets the ranks a host holds.
Exit status: 0 when the plan fits, 1 when it does not, 2 for a bad flag or config.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from chunk_grpo.cli import run_cli
from chunk_grpo.cli_args import plan_parser
from chunk_grpo.config import ConfigError, build_config, parse_args
from chunk_grpo.memory_plan import GB, Plan, format_plan, levers_by_effect, plan_for_config


def main(argv: list[str] | None = None) -> Plan:
    argv = sys.argv[1:] if argv is None else argv
    args, rest = plan_parser().parse_known_args(argv)
    yaml_path, overrides, resume = parse_args(rest, prog="python -m chunk_grpo.plan")
    if resume:
        raise ConfigError("the plan reads a config, not a run: give --config (or the run's "
                          "config.yaml as --config RUN/config.yaml)")
    cfg = build_config(yaml_path, overrides)
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


if __name__ == "__main__":
    run_cli(main, "chunk_grpo.plan")
