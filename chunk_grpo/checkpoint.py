"""Atomic checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint is a directory `checkpoints/step-XXXXXXXX/` holding `state.pt`. It is written under a
temporary name and renamed into place (os.replace), and `checkpoints/latest` (a one-line file, also
replaced atomically) names the newest complete one; a run killed mid-write leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(run_dir: str | Path, step: int, state: dict, keep: int = 2) -> Path:
    """Write ``state`` (tensors and plain Python objects) as checkpoint ``step``."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    torch.save(dict(state, step=step, rng=rng_state()), tmp / "state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(root / "latest", final.name + "\n")
    old = sorted(p for p in root.glob("step-*") if p.is_dir() and p != final)
    for stale in old[:max(0, len(old) - (keep - 1))]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / "state.pt").is_file() else None


def load_checkpoint(path: str | Path, *, restore_rng: bool = True) -> dict:
    """Load a checkpoint directory (or a run directory: its latest checkpoint)."""
    path = Path(path)
    if not (path / "state.pt").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise ValueError(f"no checkpoint in {str(path)!r}: expected a run directory with "
                             "checkpoints/latest or a checkpoint directory with state.pt")
        path = found
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    if restore_rng:
        set_rng_state(state["rng"])
    return state
