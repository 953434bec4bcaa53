"""Spread the FLUX transformer over the ranks of a torchrun job: FSDP2, DDP or nothing.

`parallelize_transformer` applies, in torchtitan's order: activation checkpointing per block ->
optional `torch.compile` per block -> `fully_shard` (FSDP2) per double block
(`transformer_blocks`) and single block (`single_transformer_blocks`) -> the root. FSDP2 keeps
fp32 master weights sharded on dim 0 (DTensors) and computes in `param_dtype` (bf16), reducing
gradients in `reduce_dtype` (fp32 or bf16, `parallel.reduce_dtype`). DDP (torch's) keeps a full
copy per rank and all-reduces gradients in buckets. LoRA works with both: frozen base weights
and trainable adapters share a block.

The training loop then needs three things from here, around every optimizer step:
`sync_gradients` (DDP: skip the all-reduce on all but the last micro-batch; FSDP2 reduce-scatters
every micro-batch, so each rank only ever holds its gradient shards), `clip_grad_norm` (the global
norm over the shards) and `any_rank` (all ranks skip a non-finite step together).
Under FSDP every forward and backward holds collectives: every rank must make the same calls,
and call backward even for a non-finite loss (the agreed flag then skips the step).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

PARALLELISMS = ("fsdp", "ddp", "none")


class ParallelismError(ValueError):
    """A parallelism setting that cannot run here; the message names the fix."""


def world_size() -> int:
    """Ranks in the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def flux_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """FLUX's double-stream then single-stream blocks: the units of checkpointing, compiling
    and sharding."""
    missing = [name for name in ("transformer_blocks", "single_transformer_blocks")
               if not isinstance(getattr(transformer, name, None), torch.nn.ModuleList)]
    if missing:
        raise ParallelismError(f"{type(transformer).__name__} has no {' / '.join(missing)}: "
                               "parallelize_transformer expects a FLUX transformer "
                               "(diffusers' FluxTransformer2DModel)")
    return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]


def check_parallelism(mode: str, world: int, cpu_offload: bool) -> None:
    """ParallelismError (one line) for a mode this job cannot run: checked before any weight."""
    if mode not in PARALLELISMS:
        raise ParallelismError(f"parallelism must be one of {', '.join(PARALLELISMS)}, "
                               f"got {mode!r}")
    if mode == "none" and world > 1:
        raise ParallelismError(f"parallelism 'none' runs one process, but this job has {world} "
                               "ranks; set parallelism: ddp (small models) or fsdp (FLUX.1-dev), "
                               "or launch one process")
    if cpu_offload and mode != "fsdp":
        raise ParallelismError(f"cpu_offload needs parallelism: fsdp (got {mode!r}); set "
                               "parallelism: fsdp or cpu_offload: false")


def parallelize_transformer(transformer: torch.nn.Module, *, mode: str,
                            device: torch.device | str,
                            activation_checkpointing: bool = False,
                            compile_blocks: bool = False, cpu_offload: bool = False,
                            param_dtype: torch.dtype | None = torch.bfloat16,
                            reduce_dtype: torch.dtype | None = torch.float32,
                            compile_backend: str = "inductor") -> torch.nn.Module:
    """Prepare ``transformer`` (in place) for the job's ranks; returns the module to call.

    That is the transformer itself for "fsdp" (sharded in place: attributes such as ``config``
    and the PEFT methods stay reachable) and "none", and a DistributedDataParallel wrapper for
    "ddp" (call it; read attributes on ``transformer``). Without a process group (one plain
    process) "ddp" and "fsdp" leave the transformer unwrapped: there is nothing to share.

    Build the optimizer after this call: FSDP replaces the parameters by sharded ones (collect
    them with `trainable_parameters`). The weights must be identical on every rank before the
    call (build them from the same seed): FSDP shards each rank's own copy. Or the transformer
    is on the ``meta`` device: FSDP then shards the empty parameters, and the caller
    materialises and fills the shards (`chunk_grpo.models.sharded_load`).
    """
    device = torch.device(device)
    world = world_size()
    check_parallelism(mode, world, cpu_offload)
    if cpu_offload and device.type != "cuda":
        raise ParallelismError("cpu_offload moves sharded weights off the GPU; on the CPU they "
                               "are there already: set cpu_offload: false")
    blocks = flux_blocks(transformer)
    if activation_checkpointing:
        # diffusers wraps each block call in a non-reentrant torch.utils.checkpoint: per block,
        # and the parameter names stay as they are (checkpoints and LoRA depend on them).
        transformer.enable_gradient_checkpointing()
    if compile_blocks:
        for block in blocks:
            block.compile(backend=compile_backend)  # in place: no `_orig_mod` in the names
    if mode == "none" or not dist.is_initialized():
        return transformer
    if mode == "ddp":
        # No buffer broadcast: a forward then holds no collective, so ranks may sample and
        # evaluate different numbers of batches; only backward (when syncing) all-reduces.
        return DistributedDataParallel(
            transformer, device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False)
    mesh = dist.device_mesh.init_device_mesh(device.type, (world,))
    options = dict(mesh=mesh,
                   mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype,
                                                  reduce_dtype=reduce_dtype),
                   offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(transformer, **options)  # the embedders, norms and projections outside blocks
    return transformer


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformer behind a DDP wrapper (FSDP2 modules are their own transformer)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is FSDP2-sharded (also on a 1-rank group): its state is DTensors, so it
    is checkpointed, restored and exported the sharded way."""
    return isinstance(unwrapped(model), FSDPModule)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps (sharded DTensors under FSDP)."""
    return [p for p in unwrapped(model).parameters() if p.requires_grad]


@contextmanager
def sync_gradients(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Wrap one micro-batch's forward and backward: with ``enabled`` False (all but the last
    micro-batch before an optimizer step) DDP accumulates locally (`no_sync`) and all-reduces
    the sum once, on the last one.

    FSDP2 reduce-scatters every micro-batch and adds the averaged shard to the sharded
    gradient: the same sum of micro-batch gradients, and a rank holds only 1/N of the
    gradients. Skipping its sync (`set_requires_gradient_sync(False)`) would keep the full,
    unsharded gradients of every parameter on every rank until the last micro-batch.

    DDP decides in the forward whether the backward all-reduces, so the forward belongs inside.
    """
    if not enabled and isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield


def reshard_root(model: torch.nn.Module | None) -> None:
    """Free the unsharded parameters FSDP2 keeps on a root module after a forward (it skips the
    root's reshard, expecting the backward to need them at once). After no-grad sampling no
    backward comes, and without this the root's embedders and final layers would stay
    all-gathered, in the compute dtype, through the phases that follow. Anything else: no-op."""
    model = unwrapped(model) if model is not None else None
    if isinstance(model, FSDPModule):
        model.reshard()


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The part of ``param`` this rank holds and the index of its first row: an FSDP2 DTensor's
    local dim-0 shard (FSDP2 cuts dim 0 as `torch.chunk` does), or a plain tensor whole."""
    if not isinstance(param, DTensor):
        return param.data, 0
    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"expected a dim-0 shard, got placements {param.placements}")
    local = param.to_local()
    rows = param.shape[0]
    per_rank = -(-rows // param.device_mesh.size())
    return local, min(param.device_mesh.get_local_rank() * per_rank, rows)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients to a global L2 norm of at most ``max_norm``; returns the norm before
    clipping, a 0-d tensor on the gradients' device (not read back: no host sync). Under FSDP
    each rank holds gradient shards: the norm is taken over all of them (the same number on
    every rank, and the one a single process computes); NaN/Inf if any gradient is not
    finite."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # the sum of the shards' squares, across ranks
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def any_rank(flag: bool | torch.Tensor, device: torch.device | str = "cpu") -> bool:
    """True on every rank when ``flag`` (a bool, or a bool/0-1 tensor, e.g. a device flag of a
    non-finite loss) is True on any rank, so all ranks skip the same optimizer step. One
    all-reduce and one host read."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if not distributed and not isinstance(flag, torch.Tensor):
        return bool(flag)
    value = torch.as_tensor(flag, device=device).to(torch.float32).reshape(1)
    if distributed:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def all_finite(tensors: list[torch.Tensor], device: torch.device | str = "cpu") -> bool:
    """Whether every tensor (e.g. the trained weights before a checkpoint) is finite on every
    rank; each rank checks only its own shards."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    bad = any(not bool(torch.isfinite(t.detach()).all()) for t in local if t.numel())
    return not any_rank(bad, device)
