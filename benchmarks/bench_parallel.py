"""One optimizer step of the embedded model's transformer on 1 process vs 2 CPU gloo ranks
(DDP and FSDP2): step time, time inside collectives, peak memory per rank.

    OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_parallel.py -s
    BENCH_PARALLEL_MODEL=flux-dev-width OMP_NUM_THREADS=1 python -m pytest \
        benchmarks/bench_parallel.py -s -k lora          (FLUX.1-dev's width, 1+1 blocks)

The step is what the trainer does per optimizer step: a global batch of 8 rows (the embedded
model's 64 image and 16 text tokens) as micro-batches of 2 rows (2 per rank on 2 ranks, 4 on
one process), gradient sync only on the last one, forward + backward, global
grad-norm clipping, AdamW. Same global batch, so 2 ranks do half the compute each.

Communication: torch.profiler's events of the collectives (gloo:* / nccl:* / c10d), summed per
rank; gloo runs them on its own threads, so they can overlap compute. Peak memory: resident
memory above its level before the model was built, sampled every 2 ms (each rank is its own
process; rank 0 shown). ``flux-dev-width`` is FLUX.1-dev's transformer config (3072 wide, 24
heads of 128, T5 4096 / CLIP 768 inputs, guidance embedding) with 1 double and 1 single block:
545M parameters, random weights, 4 rows of 64 image tokens (128x128 pixels; 512x512 would be
1024) and 32 text tokens per step, micro-batches of 1 row, LoRA r=16 only (full fine-tuning
needs about 9 GB per process here).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import FluxTransformer2DModel
from peak_memory import PeakMemory
from peft import LoraConfig

from chunk_grpo.models.policy import EMBEDDED_MODEL
from chunk_grpo.runtime.parallelize import (
    any_rank,
    clip_grad_norm,
    parallelize_transformer,
    sync_gradients,
    trainable_parameters,
)

MODEL = os.environ.get("BENCH_PARALLEL_MODEL", "embedded")
# image / text tokens, the global batch per optimizer step and the micro-batch, in rows
SHAPES = {"embedded": dict(tokens=64, text=16, rows=8, micro=2),
          "flux-dev-width": dict(tokens=64, text=32, rows=4, micro=1)}
SHAPE = SHAPES[MODEL]
GLOBAL_ROWS, MICRO_ROWS, WARMUP, STEPS = SHAPE["rows"], SHAPE["micro"], 1, 3
FLUX_DEV_WIDTH = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                      attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                      pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
COMM_PREFIXES = ("gloo:", "nccl:", "c10d::", "record_param_comms")
RESULTS: dict[str, dict] = {}


def build(lora: bool) -> FluxTransformer2DModel:
    torch.manual_seed(0)
    if MODEL == "embedded":
        model = FluxTransformer2DModel.from_pretrained(EMBEDDED_MODEL / "transformer")
    else:
        model = FluxTransformer2DModel(**FLUX_DEV_WIDTH)
    if lora:
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    return model


def batch(config) -> dict:
    shape = SHAPE
    g = torch.Generator().manual_seed(0)
    n, side = GLOBAL_ROWS, int(shape["tokens"] ** 0.5)
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(side)),
                                     torch.arange(float(side)), indexing="ij"), -1)
    inputs = dict(
        hidden_states=torch.randn(n, shape["tokens"], config.in_channels, generator=g),
        encoder_hidden_states=torch.randn(n, shape["text"], config.joint_attention_dim,
                                          generator=g),
        pooled_projections=torch.randn(n, config.pooled_projection_dim, generator=g),
        timestep=torch.rand(n, generator=g),
        img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(shape["text"], 3))
    if config.guidance_embeds:
        inputs["guidance"] = torch.full((n,), 3.5)
    return inputs


def optimizer_step(call, params, optimizer, inputs, rank: int, world: int) -> None:
    micro = GLOBAL_ROWS // (world * MICRO_ROWS)
    for k in range(micro):
        rows = slice((k * world + rank) * MICRO_ROWS, (k * world + rank + 1) * MICRO_ROWS)
        part = {key: v[rows] if key not in ("img_ids", "txt_ids") else v
                for key, v in inputs.items()}
        with sync_gradients(call, enabled=k == micro - 1):
            out = call(**part, return_dict=False)[0]
            (out.float().pow(2).mean() / micro).backward()
    norm = clip_grad_norm(params, 1.0)
    if not any_rank(norm != norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bench_rank(rank: int, world: int, mode: str, lora: bool) -> dict:
    with PeakMemory() as memory:
        model = build(lora)
        call = parallelize_transformer(model, mode=mode, device="cpu", param_dtype=None)
        params = trainable_parameters(call)
        optimizer = torch.optim.AdamW(params, lr=1e-5)
        inputs = batch(model.config)
        for _ in range(WARMUP):
            optimizer_step(call, params, optimizer, inputs, rank, world)
        times, comm = [], 0.0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(STEPS):
                if dist.is_initialized():
                    dist.barrier()
                start = time.perf_counter()
                optimizer_step(call, params, optimizer, inputs, rank, world)
                times.append(time.perf_counter() - start)
        for event in prof.events():
            # the barrier lining the ranks up before each timed step is not the step's
            if event.name.startswith(COMM_PREFIXES) and "barrier" not in event.name:
                comm += event.cpu_time_total / 1e6  # microseconds
    return {"step_s": statistics.median(times), "comm_s": comm / STEPS,
            "peak_mib": memory.mib, "params_m": sum(p.numel() for p in model.parameters()) / 1e6}


def _entry(rank: int, world: int, tmp: str, mode: str, lora: bool) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=world)
    try:
        torch.save(bench_rank(rank, world, mode, lora), f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run(mode: str, world: int, lora: bool) -> list[dict]:
    """Each configuration in fresh processes (1 as well), so peak memory is comparable."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, tmp, mode, lora), nprocs=world,
                           start_method="fork")
        return [torch.load(f"{tmp}/rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("mode,world", [("none", 1), ("ddp", 2), ("fsdp", 2)],
                         ids=["1-process", "ddp-2", "fsdp-2"])
def test_step(benchmark, mode, world, lora):
    if MODEL == "flux-dev-width" and not lora:
        pytest.skip("full fine-tuning of the 545M model needs about 9 GB per process")
    ranks = []
    benchmark.pedantic(lambda: ranks.extend(run(mode, world, lora)), rounds=1, iterations=1)
    first = ranks[0]
    name = f"{MODEL} {'lora' if lora else 'full'} {mode} x{world}"
    RESULTS[name] = first
    benchmark.extra_info.update({k: round(v, 3) for k, v in first.items()})
    others = ", ".join(f"{r['peak_mib']:.0f}" for r in ranks[1:]) or "-"
    print(f"\n{name}: step {first['step_s']:.3f} s, collectives {first['comm_s']:.3f} s/step, "
          f"peak {first['peak_mib']:.0f} MiB/rank (rank 0; other ranks {others}), "
          f"{first['params_m']:.1f}M parameters")
    assert all(r["step_s"] > 0 for r in ranks)


def test_summary():
    if not RESULTS:
        pytest.skip("run the step benchmarks first")
    print()
    for name, r in RESULTS.items():
        print(f"{name:40s} step {r['step_s']:7.3f} s  collectives {r['comm_s']:7.3f} s  "
              f"peak {r['peak_mib']:7.0f} MiB")


if __name__ == "__main__":
    raise SystemExit(pytest.main([str(Path(__file__)), "-s", "-q"]))
