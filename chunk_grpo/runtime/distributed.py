"""torchrun awareness: rank and world size from the environment, rank-aware prompt sampling,
and the few collectives the trainer needs. A plain `python -m` run is rank 0 of 1."""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from chunk_grpo.config.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto", *, timeout_minutes: float = 60.0,
                     tf32: bool = True) -> DistInfo:
    """Join the process group when launched by torchrun (gloo on CPU, nccl on CUDA), with
    ``timeout_minutes`` for every collective (start-up holds long waits: one rank profiles or
    encodes while others wait); on CUDA turn TF32 matmuls on or off (`set_tf32`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda is set but CUDA is not available on this machine (no GPU "
                          "visible, or a CPU-only torch); use device: cpu or auto")
    if not timeout_minutes > 0 or math.isinf(timeout_minutes):
        raise ConfigError(f"parallel.timeout_minutes must be a finite number > 0, got "
                          f"{timeout_minutes}; e.g. 60")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    set_tf32(tf32, dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                timeout=timedelta(minutes=timeout_minutes))
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def init_for_config(cfg) -> DistInfo:
    """`init_distributed` with a TrainConfig's device, process-group timeout and TF32 setting."""
    return init_distributed(cfg.run.device, timeout_minutes=cfg.parallel.timeout_minutes,
                            tf32=cfg.model.tf32)


def set_tf32(enabled: bool, device: torch.device) -> bool:
    """TF32 for fp32 matmuls and convolutions on CUDA (about 8x the fp32 rate on A100/H100, with
    a 10-bit mantissa in the products; fp32 accumulation). Returns whether the flags were set:
    only for a CUDA device, so a CPU run leaves torch's global settings alone."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return True


def sample_prompts(prompts: list[str], count: int, *, seed: int, step: int,
                   info: DistInfo) -> list[str]:
    """This rank's ``count`` prompts for ``step``: one global draw, sliced by rank.

    Depends only on (seed, step), so a resumed run sees the same prompts as an uninterrupted one
    and ranks never duplicate each other within a step (while the pool lasts).
    """
    if not prompts:
        raise ValueError("the prompt list is empty")
    rng = random.Random(f"{seed}:{step}:prompts")
    total = count * info.world_size
    order = []
    while len(order) < total:
        block = list(range(len(prompts)))
        rng.shuffle(block)
        order.extend(block)
    mine = order[info.rank * count:(info.rank + 1) * count]
    return [prompts[i] for i in mine]


def step_generator(seed: int, step: int, rank: int, purpose: str,
                   device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from (seed, step, rank, purpose): resumable without saved state."""
    key = random.Random(f"{seed}:{step}:{rank}:{purpose}").getrandbits(63)
    return torch.Generator(device=device).manual_seed(key)


def all_gather_cat(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Concatenate a [n, ...] tensor across ranks (same n everywhere)."""
    if info.world_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(info.world_size)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def local_world_size(info: DistInfo) -> int:
    """The ranks on this node (torchrun's LOCAL_WORLD_SIZE; without it, all of them)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def cleanup(info: DistInfo | None = None) -> None:
    """Leave the process group at the end of a command that joined it (``info``: that
    command's; None: whatever group is initialised)."""
    if (info is None or info.world_size > 1) and dist.is_initialized():
        # every rank past its last collective before any closes its connections: a process
        # that exits with its group still up can abort in gloo's background threads
        dist.barrier()
        dist.destroy_process_group()
