"""Atomic, verified checkpoints in torch.distributed.checkpoint (DCP) format, at any world size.

A checkpoint is a directory `checkpoints/step-XXXXXXXX/` holding DCP's files (`.metadata` and one
`__<rank>_0.distcp` per rank that wrote) and `manifest.json` (the size and sha256 of every file).
Every rank writes its own shards, nothing is gathered on rank 0, and one process without a
process group writes the same format; DCP reshards on load, so a checkpoint saved on N ranks
loads on M. The state is a dict of `Stateful` objects (or nested dicts of tensors and plain
values), saved and loaded by name. A checkpoint is written under a temporary name and renamed
into place (os.replace), and `checkpoints/latest` (replaced atomically too) names the newest; a
run killed mid-write leaves the previous checkpoint intact. Before writing, the free space is
checked; a full disk is a `DiskFullError` with the bytes needed, and the previous one is kept.

Resuming verifies every file against the manifest (each rank hashes a share): a damaged,
truncated or empty newest checkpoint, or a missing `latest`, falls back to the newest intact one
and says so in one line. Nothing in a checkpoint runs as code: tensors are read by DCP with
``weights_only``, the plain values with ``torch.load(weights_only=True)`` and DCP's `.metadata`
with an unpickler that builds only DCP's metadata classes. A checkpoint without a manifest is
refused unless the caller trusts it (``--trust-checkpoint``), and is then read the same way.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import pickle
import random
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from chunk_grpo.runtime.parallelize import unwrapped

MANIFEST = "manifest.json"
FORMAT = "dcp"
METADATA = dcp_filesystem._metadata_fn
# Only the weights being trained: LoRA adapters, or the whole transformer (the frozen base comes
# from the model files); loading them leaves the frozen weights as they are.
_TRAINABLE = StateDictOptions(ignore_frozen_params=True)
_LOAD_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)
# What earlier chunk-grpo versions wrote: a single torch.save file, or trainer.pt beside shards/.
_OLD_FORMATS = {"state.pt": "one state.pt file", "trainer.pt": "trainer.pt and shards/"}


class CheckpointError(ValueError):
    """No intact checkpoint where one was asked for; the message says what was found."""


class DiskFullError(OSError):
    """A checkpoint did not fit on the disk; the previous checkpoint is kept."""


# ----------------------------------------------------------------------------- state

class ModelState(Stateful):
    """The trained weights of a model (plain, DDP or FSDP2) keyed by parameter name: the LoRA
    adapters, or every weight under full fine-tuning; sharded DTensors under FSDP."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = get_model_state_dict(self.model, options=_TRAINABLE)
        trained = {n for n, p in unwrapped(self.model).named_parameters() if p.requires_grad}
        return {name: value for name, value in state.items() if name in trained}  # no buffers

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        set_model_state_dict(self.model, state, options=_LOAD_TRAINABLE)


class OptimizerState(Stateful):
    """An optimizer's state keyed by parameter name (so it reshards with the weights)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer, options=_TRAINABLE)

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state, options=_LOAD_TRAINABLE)


def rng_state() -> dict:
    """The python, numpy, torch and CUDA random states as tensors and plain values; "cuda" holds
    one state per visible CUDA device."""
    version, python_keys, gauss = random.getstate()
    kind, numpy_keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(numpy_keys.astype(np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
             "python": {"version": version, "keys": torch.tensor(python_keys, dtype=torch.int64),
                        "gauss": gauss}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> str | None:
    """Restore the generators of `rng_state` exactly. Of the saved CUDA states only the
    current device's is restored (this process uses no other), so a checkpoint saved where more
    GPUs were visible resumes on fewer; returns a line saying what changed when the saved and the
    visible devices differ (None otherwise)."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(k) for k in p["keys"].tolist()), p["gauss"]))
    saved = state.get("cuda") or []
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not visible:
        return (f"[chunk-grpo] resume: the checkpoint holds the CUDA generator states of "
                f"{len(saved)} GPU(s), none is visible here: not restored") if saved else None
    current = torch.cuda.current_device()
    if current < len(saved):
        torch.cuda.set_rng_state(saved[current], current)
    if len(saved) == visible:
        return None
    restored = (f"device {current}'s restored" if current < len(saved) else
                f"device {current} has none and keeps its seeded state")
    return (f"[chunk-grpo] resume: the checkpoint holds the CUDA generator states of "
            f"{len(saved)} GPU(s), {visible} visible here: {restored}")


def print_note(note: str | None) -> None:
    """Print a resume note once (on rank 0 of a distributed job)."""
    if note and rank() == 0:
        print(note, flush=True)


def state_bytes(state: object) -> int:
    """Bytes of the tensors and arrays in a (nested) state: what a checkpoint of it needs
    (a DTensor counts its global size, written once)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, np.ndarray):
        return state.nbytes
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


# ----------------------------------------------------------------------------- ranks

def rank() -> int:
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


def _dcp(call):
    """Run a DCP save or load (without a process group on one process, quietly), raising what
    failed inside it rather than DCP's per-rank wrapper."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            return call(no_dist=not dist.is_initialized())
    except CheckpointException as err:
        causes = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
        for cause in causes:
            # Ctrl-C or SIGTERM while writing: the run stops as on any interrupt (the previous
            # checkpoint is intact, this one was never published)
            if isinstance(cause, (KeyboardInterrupt, CheckpointError, OSError)):
                raise cause from None
        raise causes[0] if causes and isinstance(causes[0], Exception) else err from None


# ----------------------------------------------------------------------------- files

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_hashes(directory: Path, names: list[str] | None = None) -> dict[str, dict]:
    """{relative path: {bytes, sha256}} of ``names`` (default: every file below ``directory``);
    each rank hashes an equal share (a shared filesystem), gathered on every rank."""
    if names is None:
        names = [str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()]
    mine = {name: {"bytes": (directory / name).stat().st_size, "sha256": _sha256(directory / name)}
            for name in sorted(names)[rank()::_world()]}
    if not dist.is_initialized():
        return mine
    parts = [None] * _world()
    dist.all_gather_object(parts, mine)
    return {name: entry for part in parts for name, entry in sorted(part.items())}


def _disk_full(root: Path, needed: int, previous: Path | None) -> DiskFullError:
    free = shutil.disk_usage(root).free
    kept = f"the previous checkpoint {previous} is kept" if previous else "no earlier checkpoint"
    return DiskFullError(errno.ENOSPC, f"no space left on device for a checkpoint in {root}: it "
                         f"needs about {needed} bytes, {free} are free; {kept}. Free some space "
                         f"(or lower keep_checkpoints) and resume with --resume")


def _is_disk_full(err: BaseException) -> bool:
    # torch reports a short write as RuntimeError("... unexpected pos ...")
    return ((isinstance(err, OSError) and err.errno == errno.ENOSPC)
            or (isinstance(err, RuntimeError) and "unexpected pos" in str(err)))


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``state`` ({name: Stateful, or a nested dict of tensors and plain values}) as
    checkpoint ``step`` with its manifest, and keep the newest ``keep``. Every rank calls this;
    per-rank values need per-rank names (DCP writes one copy of equal names). Raises
    DiskFullError (leaving the previous checkpoint) when it does not fit."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    plain = {name: value.state_dict() if isinstance(value, Stateful) else value
             for name, value in state.items()}
    needed = state_bytes(plain) + (1 << 20)  # DCP's metadata and the plain values besides
    problem = None
    if rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(root).free < needed:
            problem = str(_disk_full(root, needed, latest_checkpoint(run_dir)))
        elif tmp.exists():
            shutil.rmtree(tmp)
    problem = _broadcast(problem)
    if problem is not None:
        raise DiskFullError(errno.ENOSPC, problem)  # on every rank; the previous one is kept
    try:  # the broadcast above waited for rank 0 to clear a stale temporary directory
        _dcp(lambda **kw: dcp.save(plain, checkpoint_id=tmp, **kw))
        _barrier()
        files = _file_hashes(tmp)
    except BaseException as err:
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if _is_disk_full(err):
            raise _disk_full(root, needed, latest_checkpoint(run_dir)) from None
        raise
    if rank() == 0:
        manifest = {"step": step, "format": FORMAT, "world_size": _world(), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        publish_checkpoint(tmp, final, keep)
    _barrier()
    return final


def publish_checkpoint(tmp: Path, final: Path, keep: int) -> None:
    """Rename a complete checkpoint directory into place, point `latest` at it and delete all
    but the newest ``keep`` checkpoints: a crash at any point leaves an intact one."""
    root = final.parent
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / "latest.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / "latest")
    old = sorted(p for p in root.glob("step-*") if p.is_dir() and p != final)
    for stale in old[:max(0, len(old) - (keep - 1))]:
        shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint `checkpoints/latest` names, if it exists (not verified)."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    try:
        path = pointer.parent / pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    found = any((path / name).is_file() for name in (MANIFEST, METADATA, *_OLD_FORMATS))
    return path if found else None


# ----------------------------------------------------------------------------- verification

NO_MANIFEST = (f"no {MANIFEST}: not written by chunk-grpo, or damaged; if you trust where it "
               "came from, resume with --trust-checkpoint")


def old_format(path: Path) -> str | None:
    """One line saying how to go on, when ``path`` is an earlier chunk-grpo's checkpoint."""
    for name, what in _OLD_FORMATS.items():
        if (path / name).is_file():
            return (f"{path} was written by an earlier chunk-grpo ({what}), which this version "
                    "does not read: resume it with the chunk-grpo version that wrote it, or "
                    "start a new run with another output_dir")
    return None


def checkpoint_problem(path: Path, trust: bool = False) -> str | None:
    """Why the checkpoint directory ``path`` cannot be trusted, or None if it is intact: every
    file its manifest lists has its size and sha256 (each rank hashes a share: every rank calls
    this). Nothing is deserialised. Without a manifest it is refused unless ``trust``."""
    if not (path / MANIFEST).is_file():
        if not trust:
            return NO_MANIFEST
        return None if (path / METADATA).is_file() else f"no {METADATA}"
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        sizes = {name: int(entry["bytes"]) for name, entry in files.items()}
        if METADATA not in files:
            return f"{MANIFEST} does not list {METADATA}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is damaged"
    for name, size in sorted(sizes.items()):  # sizes first: a truncated file needs no hashing
        found = (path / name).stat().st_size if (path / name).is_file() else None
        if found is None:
            return f"{name} is missing"
        if found != size:
            return (f"{name} is empty" if found == 0 else
                    f"{name} has {found} bytes, its manifest says {size} (truncated?)")
    found = _file_hashes(path, list(files))
    damaged = [name for name in sorted(files) if found[name]["sha256"] != files[name]["sha256"]]
    return f"{damaged[0]} does not match its manifest's sha256 (damaged)" if damaged else None


def _stderr(line: str) -> None:
    if rank() == 0:
        print(line, file=sys.stderr, flush=True)


def find_resumable(run_dir: str | Path, report=None, *, trust: bool = False) -> Path:
    """The newest intact checkpoint of a run, whatever `checkpoints/latest` says (every rank
    calls this). A damaged one (or one without a manifest, unless ``trust``), and a `latest`
    pointer that names an older or missing checkpoint, are reported in one line to ``report``
    (default: stderr). Raises CheckpointError if none is intact, or the newest is an earlier
    version's."""
    report = report or _stderr
    root = Path(run_dir) / "checkpoints"
    candidates = sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True)
    pointed = latest_checkpoint(run_dir)
    skipped = []
    for path in candidates:
        if old_format(path):
            raise CheckpointError(old_format(path))
        problem = checkpoint_problem(path, trust)
        if problem is None:
            if skipped:
                report(f"[chunk-grpo] skipped damaged checkpoint(s) {'; '.join(skipped)}; "
                       f"resuming from {path}")
            elif pointed is None:
                report(f"[chunk-grpo] {root / 'latest'} is missing or stale; resuming from "
                       f"{path}, the newest intact checkpoint")
            elif pointed != path:
                report(f"[chunk-grpo] {root / 'latest'} names {pointed.name}, but {path.name} "
                       f"is newer and intact; resuming from {path}")
            return path
        skipped.append(f"{path.name} ({problem})")
    found = "; ".join(skipped) if skipped else "none"
    raise CheckpointError(f"no intact checkpoint in {root} (found: {found}); start a new run "
                          "with another output_dir")


def select_checkpoint(path: str | Path, *, trust: bool = False) -> Path:
    """The checkpoint directory ``path`` names, verified: itself (no fallback), or a run
    directory's newest intact checkpoint (damaged ones are skipped with a line from rank 0).
    Every rank calls this; nothing is deserialised."""
    path = Path(path)
    if old_format(path):
        raise CheckpointError(old_format(path))
    if (path / MANIFEST).is_file() or (path / METADATA).is_file():
        problem = checkpoint_problem(path, trust)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} is damaged: {problem}; give its run "
                                  "directory to fall back to an earlier one")
        return path
    if not (path / "checkpoints").is_dir():
        raise CheckpointError(f"no checkpoint in {str(path)!r}: give a run directory or a "
                              "step-XXXXXXXX directory")
    return find_resumable(path, report=print_note, trust=trust)


# ----------------------------------------------------------------------------- reading

def _not_plain(where: object, err: pickle.UnpicklingError) -> CheckpointError:
    what = str(err).split("Unsupported global: GLOBAL ")[-1].split(" ")[0].strip(".")
    found = f" (e.g. {what})" if "Unsupported global" in str(err) else ""
    return CheckpointError(
        f"{where} holds objects other than tensors and plain values{found}, so it is not "
        "loaded (unpickling them could run code): it was not written by this version of "
        "chunk-grpo. Start a new run, or resume an earlier version's run with that version")


class _PlainValuesPlanner(DefaultLoadPlanner):
    """DCP's load planner reading the non-tensor values with ``weights_only=True``."""

    def __init__(self, where: Path):
        super().__init__()
        self.where = where

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise _not_plain(f"{self.where} ({fqn})", err) from None
        set_element(self.original_state_dict, self.mappings[fqn], obj)


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
        path = pathlib.Path(self.path) / METADATA
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


def saved_names(path: Path) -> dict[str, set[str]]:
    """{top-level name: the names below it} of checkpoint ``path`` (from its metadata)."""
    names: dict[str, set[str]] = {}
    for fqn_path in SafeReader(path).read_metadata().planner_data.values():
        names.setdefault(str(fqn_path[0]), set()).add(str(fqn_path[1]) if len(fqn_path) > 1
                                                      else "")
    return names


def read_checkpoint(path: Path, names: tuple[str, ...] | None = None) -> dict:
    """The entries ``names`` (default: all) of the verified checkpoint ``path`` as a nested
    dict of full CPU tensors and plain values, built from its metadata alone (no model needed:
    e.g. the run state a trainer is built from). Every rank calls this."""
    reader = SafeReader(path)
    metadata = reader.read_metadata()
    state: dict = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        where = metadata.planner_data[fqn]
        if names is not None and where[0] not in names:
            continue
        value = (torch.empty(entry.size, dtype=entry.properties.dtype)
                 if isinstance(entry, dcp_metadata.TensorStorageMetadata) else None)
        set_element(state, where, value)
    _dcp(lambda **kw: dcp.load(state, storage_reader=reader, planner=_PlainValuesPlanner(path),
                               **kw))
    return state


def restore_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Load the verified checkpoint ``path`` into ``state`` ({name: Stateful or nested dict of
    tensors}) in place, at any world size (DCP reshards). Every rank calls this. A model that
    trains other weights than the checkpoint holds is a CheckpointError naming one."""
    reader = SafeReader(path)
    saved = saved_names(path)
    for name, value in state.items():
        if isinstance(value, ModelState):
            wanted = set(value.state_dict())
            if saved.get(name, set()) != wanted:
                odd = sorted(saved.get(name, set()) ^ wanted)[0]
                raise CheckpointError(f"checkpoint {path} trains other weights than this model "
                                      f"(e.g. {odd}); was it saved with another LoRA / model "
                                      "configuration?")
    _dcp(lambda **kw: dcp.load(state, storage_reader=reader, planner=_PlainValuesPlanner(path),
                               **kw))


def load_checkpoint(path: str | Path, *, trust: bool = False,
                    names: tuple[str, ...] | None = None) -> dict:
    """A checkpoint directory (or a run directory's newest intact checkpoint), verified against
    its manifest and read as `read_checkpoint` does. ``trust``: accept one without a manifest
    (read the same restricted way)."""
    return read_checkpoint(select_checkpoint(path, trust=trust), names)
