"""One iteration of the FLUX.1-dev preset on a FLUX.1-dev-width model, measured on one GPU.

Part of `python -m chunk_grpo.gpu_check`, which runs it in its own process (a fresh CUDA
allocator, its own 1-rank process group):

    python -m chunk_grpo.analysis.gpu_check_preset --out DIR [--config configs/flux_dev_hpsv3.yaml]

The model: FLUX.1-dev's real transformer config with 2 double-stream and 2 single-stream blocks
(every width real: 3072 hidden, 24 heads of 128, guidance embedding), its real VAE config, and
tiny text encoders with T5-XXL's and CLIP-L's output widths (`chunk_grpo.models.tiny`), random
weights, saved in bf16 (as FLUX.1-dev ships) in the diffusers layout. The run: the preset's
settings (bf16 autocast, full fine-tuning, FSDP2 on a 1-rank NCCL group, micro-batch 1 with its
gradient accumulation, 720x720, 17 steps, groups of 12, the hybrid base) with overrides only for
what a check cannot take from the preset: the model, the prompt files, one iteration
(`max_steps`), 12 evaluation images instead of 400, and the reward: `jpeg_compressibility`
instead of HPSv3 (a 7.75B checkpoint not part of the check; the plan counts the reward of the
config it is given, so plan and run still agree).

Measured: the CUDA allocator's peak (`torch.cuda.max_memory_allocated`) during the start-up
(loading, prompt caching, building the trainer) and during the iteration, against the memory
plan of this exact config (`plan_for_config` at world size 1 and the GPU's memory); the
trainer's own seconds per phase (its `time/*` metrics); and the host syncs of the iteration,
counted with `torch.cuda.set_sync_debug_mode("warn")` by call site. The result is DIR/result.json
(the model, checkpoints and export are deleted afterwards; the run's logs and metrics stay).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "configs" / "flux_dev_hpsv3.yaml"
BLOCKS = dict(num_layers=2, num_single_layers=2)
# Text encoders with T5-XXL's (4096) and CLIP-L's (768) output widths, tiny inside.
TINY_TEXT = dict(t5_d_model=4096, t5_heads=2, t5_d_kv=8, t5_d_ff=32,
                 clip_hidden=768, clip_heads=2, clip_intermediate=32)
# FLUX.1-dev's scheduler/scheduler_config.json.
FLUX_DEV_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                          base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                          max_image_seq_len=4096)
TRAIN_PROMPTS = ["a red cat on a sofa", "a blue car in the rain", "a portrait of an old man",
                 "a castle on a hill at sunset", "a bowl of fruit on a wooden table",
                 "a lighthouse in a storm", "two dogs playing in the snow", "a city at night"]
EVAL_PROMPTS = ["a green apple on a table", "a dog running on the beach"]
EVAL_IMAGES = 12  # one rollout batch (the preset: 400)
SYNC_MESSAGE = "synchronizing CUDA operation"
PROJECT_DIRS = (f"{os.sep}chunk_grpo{os.sep}", f"{os.sep}grpo_kernels{os.sep}")


def save_flux_dev_width(directory: Path, device: str) -> dict:
    """The model described above, saved to ``directory``; returns its sizes."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    from chunk_grpo.models.tiny import build_tiny_flux_pipeline
    from chunk_grpo.plan.models import build_transformer, build_vae, resolve_model_configs

    torch.manual_seed(0)
    words = sorted({w for p in TRAIN_PROMPTS + EVAL_PROMPTS for w in p.split()})
    pipeline = build_tiny_flux_pipeline(words, **TINY_TEXT)  # the encoders and tokenizers
    flux = resolve_model_configs("black-forest-labs/FLUX.1-dev")
    # Random init on the GPU (seconds, not minutes on the host), stored in bf16 on the host.
    transformer = build_transformer({**flux.transformer, **BLOCKS}, device=device)
    transformer = transformer.to(torch.bfloat16).cpu()
    vae = build_vae(flux.vae, device=device).to(torch.bfloat16).cpu()
    pipeline.register_modules(transformer=transformer, vae=vae,
                              scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER))
    pipeline.save_pretrained(directory)
    return {"transformer_parameters": sum(p.numel() for p in transformer.parameters()),
            "vae_parameters": sum(p.numel() for p in vae.parameters()),
            **BLOCKS, "config_source": flux.source}


def preset_overrides(work: Path, model_dir: Path) -> dict:
    """Every setting that departs from the preset (see the module docstring)."""
    train, heldout = work / "train_prompts.txt", work / "eval_prompts.txt"
    train.write_text("\n".join(TRAIN_PROMPTS) + "\n")
    heldout.write_text("\n".join(EVAL_PROMPTS) + "\n")
    return dict(model=str(model_dir), reward="jpeg_compressibility",
                train_prompts=str(train), eval_prompts=str(heldout),
                output_dir=str(work / "run"), prompt_cache_dir=str(work / "prompt-cache"),
                max_steps=1, eval_images=EVAL_IMAGES, final_eval_images=EVAL_IMAGES,
                progress=False)


class SyncCounter:
    """Counts the warnings of `torch.cuda.set_sync_debug_mode("warn")` by call site: the
    innermost frame in chunk_grpo/grpo_kernels, and the frame the warning names."""

    def __init__(self):
        self.sites: Counter = Counter()

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_MESSAGE not in str(message):
            return self.fallback(message, category, filename, lineno, file, line)
        ours = [f for f in traceback.extract_stack()[:-1]
                if any(d in f.filename for d in PROJECT_DIRS) and "gpu_check" not in f.filename]
        where = (f"{_short(ours[-1].filename)}:{ours[-1].lineno} ({ours[-1].name})" if ours
                 else "outside the project")
        self.sites[(where, f"{_short(filename)}:{lineno}")] += 1

    @contextlib.contextmanager
    def counting(self):
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            self.fallback = warnings.showwarning
            warnings.showwarning = self.showwarning
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                torch.cuda.set_sync_debug_mode("default")

    def to_dict(self, top: int = 10) -> dict:
        return {"count": sum(self.sites.values()),
                "top": [{"site": site, "warned_at": at, "count": n}
                        for (site, at), n in self.sites.most_common(top)]}


def _short(path: str) -> str:
    for marker in PROJECT_DIRS + (f"{os.sep}torch{os.sep}",):
        if marker in path:
            return marker.strip(os.sep) + os.sep + path.split(marker, 1)[1]
    return path


def measure_iterations(train_module, result: dict, syncs: SyncCounter) -> None:
    """Wrap the trainer's `train_iteration` so each iteration's allocator peak, seconds and
    host syncs are recorded in ``result`` (the start-up's peak is read before the first)."""
    import torch

    original = train_module.train_iteration

    def measured(tr, step):
        torch.cuda.synchronize()
        result.setdefault("startup_peak_bytes", torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with syncs.counting():
            out = original(tr, step)
        torch.cuda.synchronize()
        result["iteration_seconds"] = time.perf_counter() - start
        result["iteration_peak_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()  # what follows (evaluation, saving) on its own
        return out

    train_module.train_iteration = measured


def phase_memory_peaks(records: list[dict]) -> dict | None:
    """Per-phase peaks when `chunk_grpo.train.phase_memory` exists (its metrics `memory/*`); None
    when the module does not."""
    try:
        import chunk_grpo.train.phase_memory  # noqa: F401
    except ImportError:
        return None
    return {k: v for r in records for k, v in r.items() if k.startswith("memory/")}


def run(out: Path, config: Path) -> dict:
    """Build the model, run one iteration, measure; the result (also written to out)."""
    import torch
    import torch.distributed as dist

    from chunk_grpo.config.parsing import build_config
    from chunk_grpo.plan.memory import GB, plan_for_config
    from chunk_grpo.train import loop as train_module
    from chunk_grpo.train.metrics import read_metrics

    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"status": "fail", "config": str(config)}
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    start = time.perf_counter()
    result["model"] = save_flux_dev_width(out / "model", str(device))
    result["model_build_seconds"] = time.perf_counter() - start
    overrides = preset_overrides(out, out / "model")
    result["overrides"] = overrides
    cfg = build_config(config, overrides)
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory
    plan = plan_for_config(cfg, 1, gpu_bytes, device="cuda")
    context = sum(r.gpu_bytes for r in plan.rows if r.part.startswith("CUDA context"))
    result["plan"] = {"peak_bytes": plan.peak_bytes, "peak_phase": plan.peak_phase,
                      "allocator_peak_bytes": plan.peak_bytes - context,
                      "context_allowance_bytes": context, "verdict": plan.verdict(),
                      "rows": plan.to_dict()["rows"]}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    syncs = SyncCounter()
    measure_iterations(train_module, result, syncs)
    # FSDP2 needs a process group: one rank, NCCL, from MASTER_ADDR/MASTER_PORT.
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    start = time.perf_counter()
    try:
        train_module.run(cfg, run_dir=out / "run")
        result["status"] = "pass"
    except Exception as err:  # the measurements so far are still reported
        result["error"] = f"{type(err).__name__}: {' '.join(str(err).split())}"[:2000]
        result["traceback"] = traceback.format_exc()[-6000:]
    finally:
        dist.destroy_process_group()
    result["run_seconds"] = time.perf_counter() - start
    result["after_iteration_peak_bytes"] = torch.cuda.max_memory_allocated()
    result["host_syncs"] = syncs.to_dict()
    metrics = out / "run" / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    result["phase_seconds"] = {k: v for r in records for k, v in r.items()
                               if k.startswith("time/")}
    result["phase_memory"] = phase_memory_peaks(records)
    if "iteration_peak_bytes" in result:
        measured = result["iteration_peak_bytes"]
        result["plan_vs_measured"] = (result["plan"]["allocator_peak_bytes"] - measured) / measured
        result["summary"] = (f"peak {measured / GB:.1f} GB measured vs plan "
                             f"{result['plan']['allocator_peak_bytes'] / GB:.1f} GB "
                             f"({100 * result['plan_vs_measured']:+.0f}%), iteration "
                             f"{result['iteration_seconds']:.0f} s, "
                             f"{result['host_syncs']['count']} host syncs")
    if "error" in result and "iteration_peak_bytes" in result:
        result["error"] = f"after the measured iteration: {result['error']}"
    for bulky in (out / "model", out / "run" / "checkpoints", out / "run" / "final_model"):
        shutil.rmtree(bulky, ignore_errors=True)  # GBs of random weights; the logs stay
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--config", type=Path, default=PRESET)
    args = parser.parse_args(argv)
    return 0 if run(args.out, args.config)["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
