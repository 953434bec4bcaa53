"""Run a function on N CPU ranks (gloo) in forked processes, for the distributed tests.

`run_ranks(fn, world, tmp_path, *args)` calls ``fn(rank, world, tmp_path, *args)`` in each rank
with the default process group initialised, and returns what each rank returned (as saved with
torch.save), in rank order. ``fn`` must be defined at the top level of an importable module. A
rank that fails makes run_ranks raise with that rank's traceback.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, tmp: str, fn, args) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    out = Path(tmp) / f"rank{rank}.pt"
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                                world_size=world)
        result = fn(rank, world, Path(tmp), *args)
        dist.barrier()
        torch.save({"ok": result}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, tmp_path: Path, *args) -> list:
    """``fn`` on ``world`` gloo ranks; the list of their return values."""
    tmp = Path(tmp_path) / f"ranks-{fn.__name__}-{world}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        # fork: the ranks inherit the imported torch and diffusers (spawn re-imports them, which
        # takes longer than the tests themselves on a busy 2-core machine)
        mp.start_processes(_entry, args=(world, str(tmp), fn, args), nprocs=world, join=True,
                           start_method="fork")
    except mp.ProcessRaisedException:
        pass  # the rank's own traceback is reported below
    results = []
    for rank in range(world):
        path = tmp / f"rank{rank}.pt"
        if not path.is_file():
            raise RuntimeError(f"rank {rank} of {fn.__name__} died without a result")
        saved = torch.load(path, weights_only=False)
        if "error" in saved:
            raise RuntimeError(f"rank {rank} of {fn.__name__} failed:\n{saved['error']}")
        results.append(saved["ok"])
    return results
