"""The memory plan of the one-GPU QLoRA preset against a measured CPU run (by hand, not CI).

    OMP_NUM_THREADS=1 flock /work/wt/bigmem.lock python benchmarks/bench_plan_quantized.py

Runs ``python -m chunk_grpo.train`` in one process on the CPU with the levers of
configs/flux_dev_1gpu_24gb.yaml (``--preset`` picks another): LoRA r=64 on an NF4 base
quantized by bitsandbytes' CPU kernels, 8-bit AdamW (bitsandbytes' CPU path), activation
checkpointing, text encoders cached, bf16 autocast where the CPU has native bf16, parallel.mode
none. The model is the FLUX.1-dev-width one of `bench_plan_check` (FLUX.1-dev's real transformer
config with 1 double-stream and 1 single-stream block, 545M parameters, its real VAE config,
tiny text encoders of T5-XXL's and CLIP-L's widths) with the same departures for a CPU (128x128
images, 5 sampling steps, chunks 2,2, the jpeg_compressibility reward, two iterations).

The trainer records each phase's resident-memory high-water mark above its post-import baseline
(`chunk_grpo.train.phase_memory`) into RUN/phases.json; the plan (`chunk_grpo.plan.memory`, device
cpu, one process) gives each phase's device bytes plus what the process holds besides. One line
per phase: plan, measured, their difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_plan_check import TOLERANCE, write_config, write_model

from chunk_grpo.config.parsing import build_config
from chunk_grpo.plan.memory import GB, PHASES, format_plan, plan_for_config

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "configs" / "flux_dev_1gpu_24gb.yaml"


def measure(config: Path, cwd: Path) -> dict:
    """Train with ``config`` in one process; each phase's peak bytes from phases.json."""
    # Allocations of 64 KB or more mmapped: freed tensors leave the resident memory at once.
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               MALLOC_MMAP_THRESHOLD_="65536")
    result = subprocess.run([sys.executable, "-m", "chunk_grpo.train", "--config", str(config)],
                            capture_output=True, text=True, env=env, cwd=cwd)
    if result.returncode:
        raise SystemExit(f"the training run failed:\n{result.stderr[-4000:]}")
    rank = json.loads((cwd / "run" / "phases.json").read_text())["ranks"][0]
    return {name: entry["peak_bytes"] for name, entry in rank["phases"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", type=Path, default=PRESET, help="a one-process preset")
    parser.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (model, run)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.keep or scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        model = tmp / "flux-dev-width-1d1s"
        if not (model / "transformer").is_dir():
            write_model(model, 1, 1)
        config = write_config(tmp, model, args.grad_accum, preset=args.preset)
        cfg = build_config(config)
        plan = plan_for_config(cfg, 1, 24 * GB, device="cpu", gpus_per_node=1)
        print(format_plan(plan), flush=True)
        start = time.perf_counter()
        measured = measure(config, tmp)
        minutes = (time.perf_counter() - start) / 60
    print(f"\none process ({cfg.model.base_quantization} base, LoRA r={cfg.model.lora_rank}, "
          f"{cfg.optim.name}), two iterations in {minutes:.1f} min; resident memory above the "
          f"post-import baseline")
    worst = 0.0
    for phase in plan.phases:
        if phase.name not in measured:
            print(f"phase {phase.name}: not run")
            continue
        planned, top = phase.gpu_bytes + phase.host_rank_bytes, measured[phase.name]
        diff = (planned - top) / top
        worst = max(worst, abs(diff))
        flag = "" if abs(diff) <= TOLERANCE else f"  (outside {TOLERANCE:.0%})"
        print(f"phase {phase.name}: plan {planned / GB:.2f} GB, measured {top / GB:.2f} GB, "
              f"diff {100 * diff:+.1f}%{flag}")
    print(f"largest |diff| over {len([p for p in PHASES if p in measured])} phases: "
          f"{100 * worst:.1f}%")


if __name__ == "__main__":
    main()
