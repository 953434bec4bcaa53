"""torchrun awareness: rank and world size from the environment, rank-aware prompt sampling,
and the few collectives the trainer needs. A plain `python -m` run is rank 0 of 1."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from chunk_grpo.config import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the process group when launched by torchrun (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda is set but CUDA is not available on this machine (no GPU "
                          "visible, or a CPU-only torch); use device: cpu or auto")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev)


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


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def cleanup(info: DistInfo) -> None:
    if info.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
