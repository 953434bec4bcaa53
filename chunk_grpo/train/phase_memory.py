"""Peak memory and seconds of each phase of a run, measured where it runs.

    memory = PhaseMemory(device)
    with memory.phase("load"):
        ...
    memory.report()  # {"load": {"peak_bytes": ..., "seconds": ..., "calls": 1}, ...}

The peak of a phase is the whole process's (or GPU's) memory at its highest during the phase,
above a baseline taken when the `PhaseMemory` is made (after the imports): what the memory plan
(`chunk_grpo.plan.memory`) predicts per phase.
- CUDA: ``torch.cuda.reset_peak_memory_stats`` at the phase's start, then
  ``torch.cuda.max_memory_allocated`` (the caching allocator's live tensors);
- CPU (Linux): the kernel's high-water mark of the resident memory, reset at the phase's start
  by writing "5" to /proc/self/clear_refs (after glibc's heap is trimmed, so memory freed
  earlier does not count), read as VmHWM from /proc/self/status.
A phase that runs many times (rollout, train, eval) keeps its largest peak and its total seconds.
Phases do not nest: each resets the high-water mark.

`active_phase(name)` records into the `PhaseMemory` made current with ``activate()`` and does
nothing without one, so code deep in the trainer marks its phases without being handed the
recorder.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch

GB = 1e9
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_current: list[PhaseMemory] = []


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in {_STATUS}")


def _trim_heap() -> None:
    """Return the C heap's free pages to the kernel (glibc's malloc_trim; elsewhere nothing)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PhaseMemory:
    """Per phase: the peak bytes above the baseline, the seconds and the number of calls."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # Without Linux's /proc (macOS, Windows) only the seconds are measured.
        self.measures = self.cuda or (_STATUS.is_file() and _CLEAR_REFS.exists())
        self.baseline = self._current_bytes() if self.measures else 0
        self.phases: dict[str, dict] = {}

    def _current_bytes(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        return _status_bytes("VmRSS")

    def _reset_peak(self) -> None:
        if not self.measures:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _trim_heap()  # freed tensors glibc still holds would count as resident
            _CLEAR_REFS.write_text("5")  # VmHWM := VmRSS

    def _peak_bytes(self) -> int:
        if not self.measures:
            return 0
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return _status_bytes("VmHWM")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the block as phase ``name`` (its peak joins earlier runs of the phase)."""
        self._reset_peak()
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            peak = max(0, self._peak_bytes() - self.baseline)
            entry = self.phases.setdefault(name, {"peak_bytes": 0, "seconds": 0.0, "calls": 0})
            entry["peak_bytes"] = max(entry["peak_bytes"], peak)
            entry["seconds"] += seconds
            entry["calls"] += 1

    @contextlib.contextmanager
    def activate(self) -> Iterator[PhaseMemory]:
        """Make this the recorder `active_phase` writes to, for the block."""
        _current.append(self)
        try:
            yield self
        finally:
            _current.remove(self)

    def report(self) -> dict:
        """{"device", "baseline_bytes", "phases": {name: {peak_bytes, seconds, calls}}}, the
        phases in the order they first ran."""
        return {"device": str(self.device), "measures_memory": self.measures,
                "baseline_bytes": self.baseline,
                "phases": {name: dict(entry) for name, entry in self.phases.items()}}

    def metrics(self) -> dict[str, float]:
        """``memory/<phase>_gb`` of every phase so far, for the metrics log."""
        if not self.measures:
            return {}
        return {f"memory/{name}_gb": entry["peak_bytes"] / GB
                for name, entry in self.phases.items()}

    def save(self, path: str | Path, **extra) -> Path:
        """The report as JSON (with ``extra`` keys, e.g. the rank)."""
        path = Path(path)
        path.write_text(json.dumps({**self.report(), **extra}, indent=1) + "\n")
        return path


def current() -> PhaseMemory | None:
    """The active `PhaseMemory` (made current with ``activate()``), or None."""
    return _current[-1] if _current else None


def active_phase(name: str) -> contextlib.AbstractContextManager:
    """``phase(name)`` of the active `PhaseMemory`, or a context that does nothing."""
    return _current[-1].phase(name) if _current else contextlib.nullcontext()
