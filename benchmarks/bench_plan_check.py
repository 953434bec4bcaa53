"""Cross-check of the memory plan against a measured CPU run (run by hand, not in CI).

    OMP_NUM_THREADS=1 python benchmarks/bench_plan_check.py [--gradient-checkpointing]

The model is the FLUX.1-dev-shaped one of the issue: FLUX.1-dev's real transformer config with
1 double-stream and 1 single-stream block (545M parameters), FLUX.1-dev's real VAE config, tiny
text encoders with T5-XXL's and CLIP-L's output widths (`chunk_grpo.models.tiny`), random weights.
The plan (`chunk_grpo.memory_plan`) is computed for it on the CPU: fp32, one process,
parallelism none, full fine-tuning with AdamW, no hybrid-evaluation base (its second copy of
the weights would take the measured process past the memory free on this shared machine); only
its config files are written to disk.

The measurement runs in a fresh subprocess what the plan counts: it builds the same parts
(transformer, VAE, text encoders), AdamW with its state allocated by a first step, then one
training call as the trainer makes it (chunk x micro-batch rows, forward + backward), and an
optimizer step. Peak memory: the kernel's high-water mark of the process's
resident memory (VmHWM in /proc/self/status) minus its resident memory after the imports (the
interpreter, torch and diffusers, which the plan does not count). glibc returns big blocks to
the kernel when freed, so resident memory follows the live tensors.
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

import torch

from chunk_grpo.config import build_config
from chunk_grpo.memory_plan import GB, format_plan, plan_for_config
from chunk_grpo.models.sampling_defaults import SamplingDefaults
from chunk_grpo.models.tiny import build_tiny_flux_pipeline
from chunk_grpo.plan_activations import CallShape, flux_call_inputs
from chunk_grpo.plan_models import (
    FLUX_DEV_FILES,
    build_transformer,
    build_vae,
    resolve_model_configs,
)

SIZE = 256  # pixels: 256 image tokens, so a CPU call takes about a minute
TEXT_TOKENS = 128
WORDS = ["a", "red", "cat", "on", "sofa"]
# The real-width FLUX-shaped model (FLUX.1-dev's transformer config at 1 + 1 blocks).
FLUX_545M = dict(num_layers=1, num_single_layers=1)
TINY_TEXT = dict(t5_d_model=4096, t5_heads=2, t5_d_kv=8, t5_d_ff=32,
                 clip_hidden=768, clip_heads=2, clip_intermediate=32)


def write_model_configs(directory: Path) -> Path:
    """The 545M model's four config.json files and its chunk_grpo.json (no weights: the plan
    only reads configs)."""
    flux = resolve_model_configs("black-forest-labs/FLUX.1-dev")  # the shipped real configs
    pipeline = build_tiny_flux_pipeline(WORDS, **TINY_TEXT)  # tiny encoders' configs
    configs = {
        "transformer": {**flux.transformer, **FLUX_545M},
        "vae": flux.vae,
        "text_encoder": pipeline.text_encoder.config.to_dict(),
        "text_encoder_2": pipeline.text_encoder_2.config.to_dict(),
    }
    for component in FLUX_DEV_FILES:
        (directory / component).mkdir(parents=True, exist_ok=True)
        (directory / component / "config.json").write_text(json.dumps(configs[component]))
    SamplingDefaults(height=SIZE, width=SIZE, max_sequence_length=TEXT_TOKENS).save(directory)
    return directory


def bench_config(model_dir: Path, gradient_checkpointing: bool):
    return build_config(None, dict(
        model=str(model_dir), device="cpu", parallelism="none", mixed_precision="no",
        weights_dtype="fp32", lora_rank=0, optimizer="adamw", reward="jpeg_compressibility",
        gradient_checkpointing=gradient_checkpointing, num_steps=5, sde_window=0, chunks="2,2",
        micro_batch_size=2, prompts_per_step=1, group_size=2, rollout_batch_size=2,
        eval_hybrid_steps=0, text_encoders="keep"))


def _resident(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(model_dir: Path, gradient_checkpointing: bool, rows: int) -> dict:
    """The measured process: build what the plan counts, one training call, an optimizer step."""
    torch.manual_seed(0)
    base = _resident("VmRSS")
    configs = resolve_model_configs(str(model_dir))
    transformer = build_transformer(configs.transformer, device="cpu")
    vae = build_vae(configs.vae, device="cpu").requires_grad_(False)
    pipeline = build_tiny_flux_pipeline(WORDS, **TINY_TEXT)  # the text encoders (and a tiny
    encoders = (pipeline.text_encoder, pipeline.text_encoder_2)  # transformer, dropped below)
    del pipeline
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    transformer.train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
    for p in params:  # allocate the optimizer state, as after the first step of a run
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    ready = _resident("VmRSS")
    tokens = (SIZE // 16) ** 2
    inputs = flux_call_inputs(dict(transformer.config), CallShape(rows, tokens, TEXT_TOKENS),
                              torch.float32)
    start = time.perf_counter()
    out = transformer(**inputs)[0]
    out.square().mean().backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    peak = _resident("VmHWM")
    del vae, encoders  # held until here, as the plan counts them
    return {"baseline": base, "static": ready - base, "peak": peak - base, "seconds": seconds,
            "parameters": sum(p.numel() for p in params)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child), args.gradient_checkpointing, args.rows)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_configs(Path(tmp) / "flux-545m")
        cfg = bench_config(model_dir, args.gradient_checkpointing)
        start = time.perf_counter()
        plan = plan_for_config(cfg, 1, 24 * GB)
        plan_seconds = time.perf_counter() - start
        print(format_plan(plan))
        rows = 2 * cfg.optim.micro_batch_size  # the largest chunk (2) x the micro-batch
        command = [sys.executable, __file__, "--child", str(model_dir), "--rows", str(rows)]
        if args.gradient_checkpointing:
            command.append("--gradient-checkpointing")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        result = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
        measured = json.loads(result.stdout.strip().splitlines()[-1])
    planned = plan.peak_bytes
    static = plan.phase_bytes("static") - next(
        r.gpu_bytes for r in plan.rows if r.part == "rollout buffers")
    error = (planned - measured["peak"]) / measured["peak"]
    print(f"\nplan: {plan_seconds:.1f} s; measured call + step: {measured['seconds']:.1f} s "
          f"({measured['parameters'] / 1e6:.0f}M trainable parameters)")
    print(f"static parts: plan {static / GB:.2f} GB, measured {measured['static'] / GB:.2f} GB")
    print(f"peak: plan {planned / GB:.2f} GB, measured {measured['peak'] / GB:.2f} GB "
          f"(VmHWM above the post-import baseline of {measured['baseline'] / GB:.2f} GB); "
          f"plan - measured = {100 * error:+.1f}%")


if __name__ == "__main__":
    main()
