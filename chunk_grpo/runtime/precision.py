"""Mixed precision decided at run time: bf16 autocast only where the hardware runs bf16 natively.

Why: on a CPU without bf16 instructions (AVX2 only) autocast emulates bf16 and a Linear layer was
measured 21x slower than fp32, while CPUs with AVX512-BF16 or AMX run it faster than fp32. A
default measured on one machine is wrong on the other, so ``mixed_precision: auto`` asks the
hardware:
  - CUDA: bf16 where the GPU supports it (`torch.cuda.is_bf16_supported`), else fp32;
  - x86 CPU: bf16 when its flags list ``avx512_bf16`` or ``amx_bf16``, else fp32;
  - ARM CPU: bf16 when its features list ``bf16``, else fp32;
  - a CPU whose flags cannot be read: a micro-benchmark of well under a second decides.
The decision is cached per device type, so every autocast context of a run agrees.
"""

from __future__ import annotations

import functools
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

MODES = ("auto", "no", "bf16")
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 /proc/cpuinfo "flags"
_ARM_BF16_FEATURE = "bf16"  # aarch64 /proc/cpuinfo "Features"


@dataclass(frozen=True)
class PrecisionChoice:
    """What autocast does (``mode``: "no" = fp32, "bf16") and why, in words for the log."""

    mode: str
    reason: str


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (x86 "flags" or ARM "Features"), or None when
    they cannot be read (not Linux, or a sandbox without /proc)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def cpu_has_native_bf16(flags: set[str] | None) -> bool | None:
    """True/False from the flags; None when the flags do not tell."""
    if flags is None:
        return None
    if any(flag in flags for flag in _CPU_BF16_FLAGS):
        return True
    if "avx2" in flags or "avx512f" in flags:  # an x86 CPU whose flags list no bf16 unit
        return False
    if "asimd" in flags or "fp" in flags:  # an ARM CPU: bf16 is its own feature
        return _ARM_BF16_FEATURE in flags
    return None


def bf16_faster_by_benchmark(size: int = 256, repeats: int = 5) -> tuple[bool, float, float]:
    """Time a Linear layer in fp32 and under CPU bf16 autocast (a fraction of a second);
    returns (bf16 is at least 20% faster, fp32 seconds, bf16 seconds) of the best repeats."""
    layer = torch.nn.Linear(size, size)
    x = torch.randn(4 * size, size)

    def best(context) -> float:
        times = []
        with torch.no_grad():
            for _ in range(repeats):
                start = time.perf_counter()
                with context():
                    layer(x)
                times.append(time.perf_counter() - start)
        return min(times)

    fp32 = best(lambda: torch.autocast("cpu", enabled=False))
    bf16 = best(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    return bf16 < 0.8 * fp32, fp32, bf16


@functools.cache
def _auto_choice(device_type: str) -> PrecisionChoice:
    if device_type == "cuda":
        if torch.cuda.is_bf16_supported():
            return PrecisionChoice("bf16", "auto: this GPU supports bf16")
        return PrecisionChoice("no", "auto: this GPU has no bf16 support, so fp32")
    if device_type != "cpu":
        return PrecisionChoice("no", f"auto: fp32 on device type {device_type!r}")
    capability = torch.backends.cpu.get_cpu_capability()
    native = cpu_has_native_bf16(cpu_flags())
    if native is True:
        return PrecisionChoice("bf16", f"auto: this CPU ({capability}) has native bf16 "
                                       "(avx512_bf16/amx_bf16 or ARM bf16)")
    if native is False:
        return PrecisionChoice("no", f"auto: this CPU ({capability}, {platform.machine()}) has "
                                     "no native bf16, where bf16 autocast is many times slower "
                                     "than fp32, so fp32")
    faster, fp32_s, bf16_s = bf16_faster_by_benchmark()
    timing = f"Linear layer {fp32_s * 1e3:.1f} ms fp32 vs {bf16_s * 1e3:.1f} ms bf16"
    if faster:
        return PrecisionChoice("bf16", f"auto: CPU flags unreadable; bf16 measured faster "
                                       f"({timing})")
    return PrecisionChoice("no", f"auto: CPU flags unreadable; bf16 measured not faster "
                                 f"({timing}), so fp32")


def resolve_mixed_precision(requested: str, device: torch.device | str) -> PrecisionChoice:
    """The autocast mode for ``requested`` ("auto" | "no" | "bf16") on ``device``, with why."""
    if requested not in MODES:
        raise ValueError(f"mixed_precision must be one of {MODES}, got {requested!r}")
    device_type = torch.device(device).type
    if requested == "auto":
        return _auto_choice(device_type)
    if requested == "no":
        return PrecisionChoice("no", "fp32, as configured (mixed_precision: no)")
    slow = device_type == "cpu" and cpu_has_native_bf16(cpu_flags()) is False
    note = ("; this CPU has no native bf16, so expect it to be many times slower than fp32 "
            "(mixed_precision: auto picks fp32 here)") if slow else ""
    return PrecisionChoice("bf16", f"bf16 autocast, as configured{note}")
