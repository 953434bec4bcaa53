"""Sharded checkpoints for FSDP2 / DDP runs with torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the trainable weights and the optimizer state in parallel;
nothing is gathered on rank 0. A checkpoint is a directory `checkpoints/step-XXXXXXXX/` with
`shards/` (DCP's `.metadata` and `__<rank>_<n>.distcp` files), `trainer.pt` (rank 0's small state:
step, scheduler, counters, the world size and batch it was saved with) and `manifest.json`
(`"format": "dcp"`, every file's size and sha256). As in checkpoint.py it is written under a
temporary name and renamed when complete, and `checkpoints/latest` names it; `find_resumable`
skips a damaged one. DCP reshards on load, so a checkpoint saved on N ranks loads on M ranks
(or on one plain process); `resume_batch_plan` says what that changes in the batch.

Nothing in it runs as code: trainer.pt is read with ``torch.load(weights_only=True)`` and DCP's
`.metadata` (a pickle by torch's design) with an unpickler that builds only DCP's metadata
classes (`SafeReader`), both after their sha256 matched the manifest.

The final model is gathered once, onto rank 0's CPU, by `export_full_model`, and written there
in the run's export formats.
"""

from __future__ import annotations

import copy
import errno
import json
import pathlib
import pickle
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from chunk_grpo.models.policy_setup import uses_lora
from chunk_grpo.runtime.parallelize import unwrapped
from chunk_grpo.train.checkpoint import (
    MANIFEST,
    CheckpointError,
    DiskFullError,
    _disk_full,
    _sha256,
    checkpoint_problem,
    find_resumable,
    latest_checkpoint,
    print_note,
    publish_checkpoint,
    rng_state,
    safe_load,
    set_rng_state,
    state_bytes,
)
from chunk_grpo.train.export import write_exports

FORMAT = "dcp"
SHARDS = "shards"
TRAINER = "trainer.pt"
# Only the weights being trained: LoRA adapters (the frozen base comes from the model files).
_TRAINABLE = StateDictOptions(ignore_frozen_params=True)
# Loading them leaves the frozen weights as they are (the keys are checked beforehand).
_LOAD_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)


class WorldSizeError(ValueError):
    """A checkpoint's global batch cannot be kept at this world size; the message says how."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast(value):
    """Rank 0's ``value`` on every rank (a picklable object)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _file_hashes(directory: Path) -> dict[str, dict]:
    """{relative path: {bytes, sha256}} of every file below ``directory``; each rank hashes an
    equal share of the files (a shared filesystem), the results are gathered on every rank."""
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    mine = {name: {"bytes": (directory / name).stat().st_size, "sha256": _sha256(directory / name)}
            for name in files[_rank()::_world()]}
    if not dist.is_initialized():
        return mine
    parts = [None] * _world()
    dist.all_gather_object(parts, mine)
    return {name: entry for part in parts for name, entry in sorted(part.items())}


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  extra: dict | None = None) -> dict:
    """The DCP state of a run: trainable weights and optimizer state keyed by parameter name
    (sharded DTensors under FSDP), plus ``extra`` tensors (e.g. EMA shadows)."""
    model_state, optim_state = get_state_dict(model, optimizer, options=_TRAINABLE)
    state = {"model": model_state, "optimizer": optim_state}
    if extra:
        state["extra"] = extra
    return state


def save_sharded_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module,
                            optimizer: torch.optim.Optimizer, trainer_state: dict, *,
                            extra: dict | None = None, keep: int = 2) -> Path:
    """Write checkpoint ``step``: every rank calls this (a collective). ``trainer_state``
    (plain objects, rank 0's) goes to trainer.pt with the world size; ``extra`` tensors are
    sharded like the weights. Returns the checkpoint directory."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    state = sharded_state(model, optimizer, extra)
    problem = None
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        # DTensors count their global size and DDP's replicas are written once: the total
        needed = state_bytes(state) + (1 << 20)
        if shutil.disk_usage(root).free < needed:
            problem = str(_disk_full(root, needed, latest_checkpoint(run_dir)))
        elif tmp.exists():
            shutil.rmtree(tmp)
    problem = _broadcast(problem)
    if problem is not None:
        raise DiskFullError(errno.ENOSPC, problem)  # on every rank; the previous one is kept
    try:
        dcp.save(state, checkpoint_id=tmp / SHARDS)
        if _rank() == 0:
            torch.save(dict(trainer_state, step=step, world_size=_world(), rng=rng_state()),
                       tmp / TRAINER)
        _barrier()
        files = _file_hashes(tmp)
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if _rank() == 0:
        manifest = {"step": step, "format": FORMAT, "world_size": _world(), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        publish_checkpoint(tmp, final, keep)
    _barrier()
    return final


def _report(line: str) -> None:
    if _rank() == 0:
        print(line, flush=True)


def shards_problem(path: Path) -> str | None:
    """Whether every file of the sharded checkpoint ``path`` matches its manifest's sha256 (each
    rank hashes a share: every rank calls this); None when intact or without a manifest (a
    trusted one)."""
    if not (path / MANIFEST).is_file():
        return None
    expected = json.loads((path / MANIFEST).read_text())["files"]
    found = _file_hashes(path)
    damaged = sorted(name for name in expected if found.get(name) != expected[name])
    return f"{damaged[0]} does not match its manifest" if damaged else None


def select_checkpoint(path: str | Path, *, trust: bool = False) -> Path:
    """The checkpoint directory ``path`` names, verified: itself, or a run directory's newest
    intact checkpoint of either format, a sharded one checked in full (every rank calls this;
    damaged ones are skipped with a line from rank 0). Nothing is deserialised."""
    path = Path(path)
    if (path / MANIFEST).is_file() or (path / SHARDS).is_dir() or (path / "state.pt").is_file():
        problem = checkpoint_problem(path, trust)
        if problem is None and is_sharded_checkpoint(path):
            problem = shards_problem(path)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} is damaged: {problem}; give its run "
                                  "directory to fall back to an earlier one")
        return path
    if not (path / "checkpoints").is_dir():
        raise CheckpointError(f"no checkpoint in {str(path)!r}: give a run directory or a "
                              "step-XXXXXXXX directory")
    damaged: dict[Path, str] = {}
    while True:
        found = find_resumable(path, report=_report, trust=trust, exclude=damaged)
        problem = shards_problem(found) if is_sharded_checkpoint(found) else None
        if problem is None:
            return found
        damaged[found] = problem


def resolve_sharded_checkpoint(path: str | Path, *, trust: bool = False) -> Path:
    """The sharded checkpoint ``path`` names (itself, or a run directory's newest intact one),
    verified as `select_checkpoint` does."""
    path = Path(path)
    if (path / "checkpoints").is_dir() or is_sharded_checkpoint(path):
        path = select_checkpoint(path, trust=trust)
    if not is_sharded_checkpoint(path):
        raise CheckpointError(f"{path} is not a sharded checkpoint (no {SHARDS}/); give a run "
                              "directory or a step-XXXXXXXX directory written by a ddp/fsdp run")
    return path


def read_trainer_state(path: str | Path, *, trust: bool = False,
                       verified: bool = False) -> dict:
    """trainer.pt of a sharded checkpoint (or a run's newest), without loading the shards: what
    the run needs before it builds its model (e.g. the saved world size for resume_batch_plan).
    ``verified``: ``path`` is a checkpoint `select_checkpoint` returned."""
    path = Path(path) if verified else resolve_sharded_checkpoint(path, trust=trust)
    return safe_load(path / TRAINER)


def load_sharded_checkpoint(path: str | Path, model: torch.nn.Module,
                            optimizer: torch.optim.Optimizer, *, extra: dict | None = None,
                            restore_rng: bool = False, trust: bool = False,
                            verified: bool = False) -> dict:
    """Load a sharded checkpoint (or a run directory's newest intact one) into ``model``,
    ``optimizer`` and the ``extra`` tensors in place, at any world size; every rank calls this.
    Returns trainer.pt's state (with the saved ``world_size``). The files are checked against
    the manifest's sha256 first (each rank hashes a share), unless ``verified`` (``path`` is a
    checkpoint `select_checkpoint` returned)."""
    path = Path(path) if verified else resolve_sharded_checkpoint(path, trust=trust)
    trainer = safe_load(path / TRAINER)
    state = sharded_state(model, optimizer, extra)
    reader = SafeReader(path / SHARDS)
    _check_same_weights(path, reader, state["model"])
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=_LOAD_TRAINABLE)
    if restore_rng:
        print_note(set_rng_state(trainer["rng"]))
    return trainer


# What DCP's .metadata pickle is made of; anything else is refused before it is built.
_METADATA_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch dtypes and sizes, and nothing else."""

    def find_class(self, module: str, name: str):
        value = getattr(dcp_metadata, name, None) if module == dcp_metadata.__name__ else None
        allowed = ((module, name) in _METADATA_GLOBALS
                   or (isinstance(value, type) and value.__module__ == module)
                   or (module == "torch" and isinstance(getattr(torch, name, None),
                                                         torch.dtype)))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` unpickled by `_MetadataUnpickler`: a metadata file
    naming anything but DCP's own classes is a CheckpointError, not code that runs."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        path = pathlib.Path(self.path) / dcp_filesystem._metadata_fn
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as err:
            raise CheckpointError(f"{path} names {err}, which DCP metadata never holds: refused "
                                  "(unpickling it could run code); this checkpoint was not "
                                  "written by chunk-grpo") from None
        except (OSError, EOFError, ValueError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{path} does not load: {type(err).__name__}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_same_weights(path: Path, reader: SafeReader, model_state: dict) -> None:
    """The checkpoint trains exactly the model's trainable weights (DCP alone would ignore
    extra ones and name a missing one deep in a traceback)."""
    saved = {key.removeprefix("model.") for key in reader.read_metadata().state_dict_metadata
             if key.startswith("model.")}
    wanted = set(model_state)
    if saved != wanted:
        odd = sorted(saved ^ wanted)[0]
        raise CheckpointError(f"checkpoint {path} trains other weights than this model (e.g. "
                              f"{odd}); was it saved with another LoRA / model configuration?")


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether the checkpoint directory ``path`` was written by save_sharded_checkpoint."""
    return (Path(path) / SHARDS).is_dir()


@dataclass(frozen=True)
class BatchPlan:
    """Per-rank settings that keep a checkpoint's global batch at a new world size."""

    prompts_per_step: int
    grad_accum: int
    message: str | None  # one line for the log; None when nothing changes


def resume_batch_plan(*, saved_world_size: int, saved_prompts_per_step: int,
                      saved_grad_accum: int, world_size: int,
                      requested_prompts_per_step: int | None = None) -> BatchPlan:
    """The per-rank prompts and grad_accum for resuming at ``world_size``.

    Policy: a resumed run keeps the global batch it was saved with (prompts per iteration and
    rows per optimizer step, which the optimizer state and learning-rate schedule were built
    on), so the per-rank prompts and grad_accum scale by saved_world_size / world_size. If they
    cannot, that is an error naming the world sizes that can. Giving prompts_per_step explicitly
    on resume (``requested_prompts_per_step``) changes the global batch on purpose, and the line
    says so.
    """
    same = world_size == saved_world_size
    if requested_prompts_per_step is not None and (
            not same or requested_prompts_per_step != saved_prompts_per_step):
        before = saved_prompts_per_step * saved_world_size
        after = requested_prompts_per_step * world_size
        return BatchPlan(requested_prompts_per_step, saved_grad_accum,
                         f"[chunk-grpo] resuming a {saved_world_size}-rank checkpoint on "
                         f"{world_size} rank(s) with sampling.prompts_per_step "
                         f"{requested_prompts_per_step} as given: the global batch changes from "
                         f"{before} to {after} prompts per iteration")
    if same:
        return BatchPlan(saved_prompts_per_step, saved_grad_accum, None)
    total = saved_prompts_per_step * saved_world_size
    accum_total = saved_grad_accum * saved_world_size  # training calls per step, all ranks
    if total % world_size or accum_total % world_size:
        fits = [n for n in range(1, total + 1)
                if total % n == 0 and accum_total % n == 0]
        raise WorldSizeError(
            f"the checkpoint's global batch ({saved_prompts_per_step} prompts x "
            f"{saved_world_size} ranks = {total} per iteration, optim.grad_accum "
            f"{saved_grad_accum}) "
            f"cannot be split over {world_size} ranks; resume on {', '.join(map(str, fits))} "
            f"rank(s), or pass --sampling.prompts_per_step to change the global batch")
    pps, accum = total // world_size, accum_total // world_size
    accum_note = (f" and optim.grad_accum {saved_grad_accum} -> {accum}" if saved_grad_accum
                  else "")
    return BatchPlan(pps, accum,
                     f"[chunk-grpo] resuming a {saved_world_size}-rank checkpoint on {world_size} "
                     f"rank(s): sampling.prompts_per_step {saved_prompts_per_step} -> {pps} per "
                     f"rank{accum_note}; the global batch stays {total} prompts per iteration")


def gather_full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of the model (frozen ones too) as full CPU tensors on rank 0, an empty dict
    on the other ranks; every rank calls this (under FSDP it all-gathers one tensor at a time)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def plain_transformer(model: torch.nn.Module, full_state: dict[str, torch.Tensor]):
    """An unsharded copy of the (FLUX) transformer holding ``full_state``, built on the meta
    device so no second set of weights is initialised; keeps its LoRA adapters (unmerged)."""
    live = unwrapped(model)
    with torch.device("meta"):
        plain = type(live).from_config(live.config)
        if uses_lora(live):
            for name, config in live.peft_config.items():
                plain.add_adapter(copy.deepcopy(config), adapter_name=name)
    plain.load_state_dict(full_state, assign=True)
    return plain


def export_full_model(pipeline, model: torch.nn.Module, targets: Mapping[str, Path] | str | Path,
                      *, defaults=None, dtype: torch.dtype = torch.bfloat16) -> dict[str, Path]:
    """The trained transformer gathered to rank 0's CPU and written there in each format of
    ``targets`` ({format: directory}, `chunk_grpo.train.export`; a single directory is the merged
    export), in ``dtype`` (bf16 safetensors by default). Every rank calls this; rank 0 writes
    and gets the directories written. The GPU holds one full tensor at a time (gathered, then
    copied to the CPU); rank 0's CPU the whole trained state once (cast in place)."""
    if not isinstance(targets, Mapping):
        targets = {"merged": Path(targets)}
    full = gather_full_state(model)
    written = {}
    if _rank() == 0:
        plain = plain_transformer(model, full)
        full.clear()  # the plain copy holds the tensors: casting it frees each fp32 one
        written = write_exports(pipeline, plain, targets, defaults=defaults, dtype=dtype,
                                copy_weights=False)
    _barrier()
    return written
