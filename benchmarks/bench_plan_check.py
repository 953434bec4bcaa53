"""The memory plan of every phase against the peaks a real training run measures (by hand, not CI).

    OMP_NUM_THREADS=1 python benchmarks/bench_plan_check.py --ranks 2

Memory: full fine-tuning with AdamW and the hybrid base holds 18 bytes per parameter across the
ranks (fp32 weights, gradients, two moments; the bf16 base) plus each rank's working set: about
8.3 GB per rank for the 545M model on 2 ranks (the plan's train phase). The run refuses to start
with less than ``--headroom`` (default 1.5) times that free.

Runs ``python -m chunk_grpo.train`` under ``torchrun`` on ``--ranks`` gloo ranks (CPU) with the
FLUX preset's own parallel settings (configs/flux_dev_hpsv3.yaml: FSDP2, bf16 mixed precision,
bf16 frozen weights, the hybrid-evaluation base, full fine-tuning with AdamW, micro-batch 1,
gradient checkpointing, text encoders cached) and ``grad_accum`` 4, two iterations, on the
FLUX.1-dev-width model: FLUX.1-dev's real transformer config with 1 double-stream and 1
single-stream block (545M parameters; ``--double-blocks``/``--single-blocks`` change the depth)
and FLUX.1-dev's real VAE config, random weights saved in
diffusers layout (the transformer in bf16, as FLUX.1-dev ships), tiny text encoders with T5-XXL's
and CLIP-L's output widths (`chunk_grpo.models.tiny`). What departs from the preset, for a CPU:
128x128 images, 5 sampling steps (chunks 2,2, half trained), 4 rollouts per rank, 2 evaluation
images, the programmatic jpeg_compressibility reward (no reward model to download).

The trainer records each phase's peak with `chunk_grpo.train.phase_memory` (per rank: the process's
resident-memory high-water mark above its resident memory after the imports, the mark reset at
each phase's start) into RUN/phases.json. The plan (`chunk_grpo.plan.memory`) of the same config
on the CPU gives each phase's bytes per device plus what one rank holds on its CPU besides; on a
CPU run the two are one process's memory (`PhasePlan.process_bytes`: with the checkpoint rows a
rank maps while it fills its shards, which a GPU node holds in its page cache). One line per phase
compares the plan with the largest rank's measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from chunk_grpo.config.parsing import build_config
from chunk_grpo.models.sampling_defaults import SamplingDefaults
from chunk_grpo.models.tiny import build_tiny_flux_pipeline
from chunk_grpo.plan.memory import GB, PHASES, format_plan, plan_for_config
from chunk_grpo.plan.models import build_transformer, build_vae, resolve_model_configs

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "configs" / "flux_dev_hpsv3.yaml"
SIZE = 128  # pixels: 64 image tokens, so the 545M model's calls take seconds on a CPU
TEXT_TOKENS = 32
TRAIN_PROMPTS = ["a red cat on a sofa", "a blue car in the rain", "a portrait of an old man",
                 "a castle on a hill at sunset"]
EVAL_PROMPTS = ["a green apple on a table", "a dog running on the beach"]
TINY_TEXT = dict(t5_d_model=4096, t5_heads=2, t5_d_kv=8, t5_d_ff=32,
                 clip_hidden=768, clip_heads=2, clip_intermediate=32)
TOLERANCE = 0.15


def write_model(directory: Path, doubles: int, singles: int) -> Path:
    """FLUX.1-dev's transformer config with ``doubles`` + ``singles`` blocks (1 + 1: 545M
    parameters), in diffusers layout with random weights."""
    flux = resolve_model_configs("black-forest-labs/FLUX.1-dev")  # the shipped real configs
    words = sorted({w for p in TRAIN_PROMPTS + EVAL_PROMPTS for w in p.split()})
    pipeline = build_tiny_flux_pipeline(words, **TINY_TEXT)
    torch.manual_seed(0)
    transformer = build_transformer({**flux.transformer, "num_layers": doubles,
                                     "num_single_layers": singles}, device="cpu")
    pipeline.register_modules(transformer=transformer.to(torch.bfloat16),
                              vae=build_vae(flux.vae, device="cpu"))
    pipeline.save_pretrained(directory)
    SamplingDefaults(height=SIZE, width=SIZE, max_sequence_length=TEXT_TOKENS,
                     num_steps=4).save(directory)
    del pipeline, transformer
    gc.collect()
    return directory


def write_config(tmp: Path, model: Path, grad_accum: int, preset: Path = PRESET) -> Path:
    """``preset`` with the CPU's departures (module docstring)."""
    cfg = yaml.safe_load(preset.read_text())
    (tmp / "train.txt").write_text("\n".join(TRAIN_PROMPTS) + "\n")
    (tmp / "eval.txt").write_text("\n".join(EVAL_PROMPTS) + "\n")
    cfg["model"].update(name=str(model), height=SIZE, width=SIZE,
                        prompt_cache_dir=str(tmp / "prompt-cache"))
    cfg["reward"] = {"name": "jpeg_compressibility"}
    cfg["data"] = {"train_prompts": str(tmp / "train.txt"), "eval_prompts": str(tmp / "eval.txt")}
    cfg["sampling"].update(steps=5, group_size=4, prompts_per_step=1, batch_size=4)
    cfg["chunks"].update(spec="2,2", profile_prompts=2)
    cfg["optim"].update(micro_batch_size=1, grad_accum=grad_accum)
    cfg["eval"].update(every=0, images=2, final_images=2, hybrid_steps=2)
    # Two iterations: the second samples and scores with the optimizer state allocated.
    cfg["run"].update(output_dir=str(tmp / "run"), max_steps=2, checkpoint_every=2,
                      device="cpu", progress=False)
    path = tmp / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--double-blocks", type=int, default=1, metavar="N",
                        help="double-stream blocks of the FLUX.1-dev-width model (default 1)")
    parser.add_argument("--single-blocks", type=int, default=1, metavar="N",
                        help="single-stream blocks (default 1)")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (model, run)")
    parser.add_argument("--headroom", type=float, default=1.5,
                        help="free memory needed, as a multiple of the plan's peak (default 1.5)")
    args = parser.parse_args()
    if args.grad_accum < 4:
        parser.error("--grad-accum must be >= 4: the check is of accumulation")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.keep or scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        model = tmp / f"flux-dev-width-{args.double_blocks}d{args.single_blocks}s"
        if not (model / "transformer").is_dir():
            write_model(model, args.double_blocks, args.single_blocks)
        config = write_config(tmp, model, args.grad_accum)
        cfg = build_config(config)
        plan = plan_for_config(cfg, args.ranks, 24 * GB, device="cpu", gpus_per_node=args.ranks)
        print(format_plan(plan, parts=False), flush=True)
        per_process = {p.name: p.process_bytes for p in plan.phases}
        needed = args.headroom * args.ranks * max(per_process.values())
        if _available_bytes() < needed:
            raise SystemExit(f"needs about {needed / GB:.1f} GB of free memory for {args.ranks} "
                             f"ranks, {_available_bytes() / GB:.1f} GB available; try later")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(args.ranks), "-m", "chunk_grpo.train",
                   "--config", str(config)]
        # Every allocation of 64 KB or more mmapped: freed tensors leave the resident memory at
        # once, as they leave a GPU's allocated bytes (glibc otherwise keeps freed blocks below
        # its adaptive threshold, up to 32 MB, in its heap).
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   MALLOC_MMAP_THRESHOLD_="65536")
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp)
        if result.returncode:
            raise SystemExit(f"the training run failed:\n{result.stderr[-4000:]}")
        minutes = (time.perf_counter() - start) / 60
        ranks = json.loads((tmp / "run" / "phases.json").read_text())["ranks"]
    baselines = ", ".join(f"{r['baseline_bytes'] / GB:.2f}" for r in ranks)
    print(f"\n{args.ranks} ranks, two iterations in {minutes:.1f} min; per rank: resident "
          f"memory above the post-import baseline ({baselines} GB)")
    worst = 0.0
    for name in PHASES:
        measured = [r["phases"].get(name, {}).get("peak_bytes") for r in ranks]
        if any(m is None for m in measured):
            print(f"phase {name}: not run")
            continue
        top, planned = max(measured), per_process[name]
        diff = (planned - top) / top
        worst = max(worst, abs(diff))
        ranks_text = ", ".join(f"{m / GB:.2f}" for m in measured)
        flag = "" if abs(diff) <= TOLERANCE else "  (outside 15%)"
        print(f"phase {name}: plan {planned / GB:.2f} GB, measured {top / GB:.2f} GB, "
              f"diff {100 * diff:+.1f}%{flag}   [ranks: {ranks_text} GB]")
    print(f"largest |diff|: {100 * worst:.1f}% (tolerance {100 * TOLERANCE:.0f}%)")


if __name__ == "__main__":
    main()
