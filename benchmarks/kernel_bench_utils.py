"""Measurement helpers for the kernel benchmarks: peak memory, counted bytes, a results table.

Peak memory: tracemalloc does not see torch's allocator, and RSS high-water marks hide reused
pages, so we use the torch profiler's allocator records (profile_memory=True): every tensor
allocation and free inside the call, in time order; the peak of their running sum is the
op's peak extra memory (its outputs included). Bandwidth: "counted bytes" are the bytes the
op must move by design (documented per op), divided by the median time; the machine's copy
bandwidth is a copy of one input into a preallocated tensor (read + write = 2 x its bytes)
timed in the same run; a clone (allocating, like most ops) is reported beside it.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

RESULTS: list[dict] = []
COPY_GBPS: dict[tuple, float] = {}
FIRST_CALL: dict[str, dict] = {}


def peak_extra_bytes(fn) -> int:
    """Peak of (bytes allocated - bytes freed) by torch while `fn()` runs. The fused kernels'
    output cache is emptied first: a buffer they keep for reuse is then allocated inside the
    window and never freed there, so it counts once, and buffers cached for other shapes or
    held by earlier results do not count."""
    from grpo_kernels.cpu_fused import OUTPUTS

    OUTPUTS.clear()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = sorted(
        (e.time_range.start, e.self_cpu_memory_usage)
        for e in prof.events()
        if e.self_cpu_memory_usage
    )
    current = peak = 0
    for _, delta in deltas:
        current += delta
        peak = max(peak, current)
    return peak


def record(benchmark, *, op, mode, backend, shape, dtype, counted_bytes, input_bytes, peak):
    """Attach the derived numbers to pytest-benchmark's row and keep them for the summary."""
    stats = benchmark.stats.stats
    median = stats.median
    row = dict(
        op=op, mode=mode, backend=backend, shape=list(shape), dtype=str(dtype).split(".")[-1],
        threads=torch.get_num_threads(), median_ms=median * 1e3, min_ms=stats.min * 1e3,
        gbps=counted_bytes / median / 1e9, counted_bytes=counted_bytes,
        peak_extra_bytes=peak, peak_vs_input=peak / input_bytes,
    )
    benchmark.extra_info.update(row)
    RESULTS.append(row)
    return row


def _key(row):
    return (row["op"], row["mode"], tuple(row["shape"]), row["dtype"])


def summary_lines() -> list[str]:
    if not RESULTS:
        return []
    reference = {_key(r): r["median_ms"] for r in RESULTS if r["backend"] == "reference"}
    lines = [
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"threads={torch.get_num_threads()}",
        f"{'op':<18}{'mode':<9}{'backend':<11}{'shape':<16}{'dtype':<9}{'median ms':>10}"
        f"{'GB/s':>8}{'% copy':>8}{'peak/in':>8}{'vs ref':>8}",
    ]
    for r in RESULTS:
        copy = COPY_GBPS.get((tuple(r["shape"]), r["dtype"]))
        ref = reference.get(_key(r))
        lines.append(
            f"{r['op']:<18}{r['mode']:<9}{r['backend']:<11}{'x'.join(map(str, r['shape'])):<16}"
            f"{r['dtype']:<9}{r['median_ms']:>10.3f}{r['gbps']:>8.2f}"
            f"{(100 * r['gbps'] / copy if copy else float('nan')):>7.0f}%"
            f"{r['peak_vs_input']:>8.2f}"
            + (f"{ref / r['median_ms']:>7.1f}x" if ref else f"{'-':>8}")
        )
    for (shape, dtype), gbps in sorted(COPY_GBPS.items()):
        lines.append(f"copy_ bandwidth {'x'.join(map(str, shape))} {dtype}: {gbps:.2f} GB/s")
    for cache, r in FIRST_CALL.items():
        lines.append(f"first fused fwd+bwd in a fresh process ({cache} kernel cache): "
                     f"{r['first_call_s']:.2f} s (second call {1e3 * r['second_call_s']:.2f} ms)")
    out = Path(os.environ.get("KERNEL_BENCH_JSON", ".benchmarks/kernels.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"copy_gbps": {f"{s}-{d}": g for (s, d), g in COPY_GBPS.items()},
                               "first_call": FIRST_CALL, "rows": RESULTS}, indent=1))
    lines.append(f"rows written to {out}")
    return lines
