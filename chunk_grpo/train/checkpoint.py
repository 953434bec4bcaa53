"""Atomic, verified checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint is a directory `checkpoints/step-XXXXXXXX/` holding `state.pt` and `manifest.json`
(the size and sha256 of every file). It is written under a temporary name and renamed into place
(os.replace), and `checkpoints/latest` (a one-line file, also replaced atomically) names the newest
complete one; a run killed mid-write leaves the previous checkpoint intact. Resuming verifies the
manifest: a damaged, truncated or empty latest checkpoint, or a missing `latest` pointer, falls
back to the newest intact checkpoint and says so; the newest intact checkpoint wins whatever
`latest` says. Before writing, the free space is checked; a full disk is a `DiskFullError` with
the bytes needed, and the previous checkpoint is kept.

Nothing in a checkpoint runs as code: `state.pt` holds tensors and plain values only (the RNG
states as tensors, the config as a dict) and is read with ``torch.load(weights_only=True)``, after
its size and sha256 match the manifest. A checkpoint without a manifest is refused unless the
caller trusts it (``--trust-checkpoint``), and is then read the same restricted way.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

MANIFEST = "manifest.json"
STATE = "state.pt"


class CheckpointError(ValueError):
    """No intact checkpoint where one was asked for; the message says what was found."""


class DiskFullError(OSError):
    """A checkpoint did not fit on the disk; the previous checkpoint is kept."""


def rng_state() -> dict:
    """The python, numpy, torch and CUDA random states as tensors and plain values (a
    checkpoint holding them loads with ``torch.load(weights_only=True)``); "cuda" holds one
    state per visible CUDA device."""
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
    if note and (not dist.is_initialized() or dist.get_rank() == 0):
        print(note, flush=True)


def safe_load(path: Path) -> dict:
    """``torch.load(path, weights_only=True)``: tensors and plain values, never code. A file
    holding anything else (another program's pickle, or an earlier chunk-grpo's numpy RNG state)
    is a CheckpointError saying so."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        what = str(err).split("Unsupported global: GLOBAL ")[-1].split(" ")[0].strip(".")
        found = f" (e.g. {what})" if "Unsupported global" in str(err) else ""
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain values{found}, so it is not "
            "loaded (unpickling them could run code): it was not written by this version of "
            "chunk-grpo. Start a new run, or resume an earlier version's run with that "
            "version") from None
    except Exception as err:  # damage the manifest did not catch (no manifest, trusted)
        raise CheckpointError(f"{path} does not load: {type(err).__name__}") from None


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def state_bytes(state: object) -> int:
    """Bytes of the tensors and arrays in a (nested) state: what a checkpoint of it needs."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, np.ndarray):
        return state.nbytes
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def nonfinite_tensors(state: dict) -> list[str]:
    """Names of the floating-point tensors of a flat state dict holding NaN or Inf."""
    return [name for name, t in state.items() if isinstance(t, torch.Tensor)
            and t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _disk_full(root: Path, needed: int, previous: Path | None) -> DiskFullError:
    free = shutil.disk_usage(root).free
    kept = f"the previous checkpoint {previous} is kept" if previous else "no earlier checkpoint"
    return DiskFullError(errno.ENOSPC, f"no space left on device for a checkpoint in {root}: it "
                         f"needs about {needed} bytes, {free} are free; {kept}. Free some space "
                         f"(or lower keep_checkpoints) and resume with --resume")


def save_checkpoint(run_dir: str | Path, step: int, state: dict, keep: int = 2) -> Path:
    """Write ``state`` (tensors and plain Python objects) as checkpoint ``step``, with its
    manifest. Raises DiskFullError (leaving the previous checkpoint) when it does not fit."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    previous = latest_checkpoint(run_dir)
    needed = state_bytes(state) + (1 << 20)  # pickled metadata and the RNG states besides
    if shutil.disk_usage(root).free < needed:
        raise _disk_full(root, needed, previous)
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        torch.save(dict(state, step=step, rng=rng_state()), tmp / STATE)
        manifest = {"step": step, "files": {STATE: {"bytes": (tmp / STATE).stat().st_size,
                                                    "sha256": _sha256(tmp / STATE)}}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    except (OSError, RuntimeError) as err:
        # torch reports a short write as RuntimeError("... unexpected pos ..."): a full disk
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError) and err.errno != errno.ENOSPC:
            raise
        if isinstance(err, RuntimeError) and "unexpected pos" not in str(err):
            raise
        raise _disk_full(root, needed, previous) from None
    publish_checkpoint(tmp, final, keep)
    return final


def publish_checkpoint(tmp: Path, final: Path, keep: int) -> None:
    """Rename a complete checkpoint directory into place, point `latest` at it and delete all
    but the newest ``keep`` checkpoints: a crash at any point leaves an intact one."""
    root = final.parent
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(root / "latest", final.name + "\n")
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
    # a sharded (DCP) checkpoint has no state.pt; its manifest is written last
    return path if (path / STATE).is_file() or (path / MANIFEST).is_file() else None


NO_MANIFEST = (f"no {MANIFEST}: not written by chunk-grpo, or damaged; if you trust where it "
               "came from, resume with --trust-checkpoint")


def checkpoint_problem(path: Path, trust: bool = False) -> str | None:
    """Why the checkpoint directory ``path`` cannot be trusted, or None if it is intact: its
    files' sizes and sha256 match its manifest (a sharded one: every file's size, and the
    sha256 of the files read before the shards, trainer.pt and DCP's .metadata). Nothing is
    deserialised here. Without a manifest it is refused unless ``trust``."""
    sharded = _sharded_files_problem(path)
    if sharded is not None:
        return sharded or None
    if (path / "shards").is_dir() and not (path / MANIFEST).is_file():
        return None if trust else NO_MANIFEST
    state = path / STATE
    if not state.is_file():
        return f"no {STATE}"
    size = state.stat().st_size
    if size == 0:
        return f"{STATE} is empty"
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return None if trust else NO_MANIFEST
    try:
        expected = json.loads(manifest_path.read_text())["files"][STATE]
        return file_problem(state, STATE, expected)
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is damaged"


def file_problem(file: Path, name: str, expected: dict, *, sha256: bool = True) -> str | None:
    """Whether ``file`` has the size (and sha256) its manifest entry ``expected`` gives."""
    if not file.is_file():
        return f"{name} is missing"
    size = file.stat().st_size
    if size != expected["bytes"]:
        return f"{name} has {size} bytes, its manifest says {expected['bytes']} (truncated?)"
    if sha256 and _sha256(file) != expected["sha256"]:
        return f"{name} does not match its manifest's sha256 (damaged)"
    return None


# A sharded checkpoint's files read before its shards: checked in full when it is chosen.
SHARDED_SMALL_FILES = ("trainer.pt", "shards/.metadata")


def _sharded_files_problem(path: Path) -> str | None:
    """For a sharded (DCP) checkpoint: "" if every file its manifest lists is there with its
    size and the small files read first (`SHARDED_SMALL_FILES`) match their sha256 (the shards'
    sha256 is checked when they are loaded, by all ranks), else the problem; None for any other
    checkpoint."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != "dcp":
        return None
    try:
        files = manifest["files"]
        for name in SHARDED_SMALL_FILES:
            if name not in files:
                return f"{MANIFEST} does not list {name}"
        for name, entry in files.items():
            problem = file_problem(path / name, name, entry,
                                   sha256=name in SHARDED_SMALL_FILES)
            if problem is not None:
                return problem
    except (KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is damaged"
    return ""


def find_resumable(run_dir: str | Path, report=None, *, trust: bool = False,
                   exclude: dict[Path, str] | None = None) -> Path:
    """The newest intact checkpoint of a run, whatever `checkpoints/latest` says. A damaged
    one (or one without a manifest, unless ``trust``), and a `latest` pointer that names an
    older or missing checkpoint, are reported in one line to ``report`` (default: stderr).
    ``exclude``: checkpoints already found damaged, with why. Raises CheckpointError if none is
    intact."""
    report = report or (lambda line: print(line, file=sys.stderr, flush=True))
    root = Path(run_dir) / "checkpoints"
    candidates = sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True)
    pointed = latest_checkpoint(run_dir)
    skipped = []
    for path in candidates:
        problem = (exclude or {}).get(path) or checkpoint_problem(path, trust)
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


def load_checkpoint(path: str | Path, *, restore_rng: bool = True, trust: bool = False) -> dict:
    """Load a checkpoint directory (or a run directory: its newest intact checkpoint), verified
    against its manifest before it is read, with ``torch.load(weights_only=True)``. ``trust``:
    accept one without a manifest (read the same restricted way)."""
    path = Path(path)
    if not (path / STATE).is_file():
        if not (path / "checkpoints").is_dir():
            raise CheckpointError(f"no checkpoint in {str(path)!r}: expected a run directory "
                                  f"with checkpoints/ or a checkpoint directory with {STATE}")
        path = find_resumable(path, trust=trust)
    else:
        problem = checkpoint_problem(path, trust)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} is damaged: {problem}; give its run "
                                  "directory to fall back to an earlier checkpoint")
    state = safe_load(path / STATE)
    if restore_rng:
        print_note(set_rng_state(state["rng"]))
    return state
