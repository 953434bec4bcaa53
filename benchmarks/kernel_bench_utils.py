"""The kernel benchmarks under pytest-benchmark: run a `grpo_kernels.benchmark.Case`, keep its
row, print the summary table and write the rows to a JSON file.

On the CPU pytest-benchmark times the call and its median is the row's; on CUDA the row's times
are CUDA events (`grpo_kernels.benchmark.time_call`: pytest-benchmark's host timer would see
only the launch), and pytest-benchmark times the call followed by a device synchronisation.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from grpo_kernels import benchmark as kb

RESULTS: list[dict] = []
FIRST_CALL: dict[str, dict] = {}


def run_case(benchmark, case: kb.Case, device: torch.device) -> dict:
    """Time ``case`` on ``device``; attach its row to pytest-benchmark's and keep it."""
    setup = (lambda: (case.args(), {})) if case.setup is not None else None
    iterations = {} if setup is not None else {"iterations": 1}
    if device.type == "cuda":
        seconds = kb.time_call(case, device)

        def synchronized(*args):
            case.fn(*args)
            torch.cuda.synchronize(device)

        benchmark.pedantic(synchronized, setup=setup, rounds=case.rounds,
                           warmup_rounds=case.warmup, **iterations)
    else:
        benchmark.pedantic(case.fn, setup=setup, rounds=case.rounds, warmup_rounds=case.warmup,
                           **iterations)
        seconds = list(benchmark.stats.stats.data)
    row = kb.make_row(case, seconds, kb.peak_extra_bytes(case, device), device)
    benchmark.extra_info.update(row)
    RESULTS.append(row)
    return row


def summary_lines() -> list[str]:
    if not RESULTS:
        return []
    rows = kb.annotate(RESULTS)
    device = rows[0]["device"]
    where = (torch.cuda.get_device_name() if device == "cuda"
             else platform.processor() or platform.machine())
    lines = [f"torch {torch.__version__}, {device}: {where}, threads={torch.get_num_threads()}",
             *kb.format_rows(rows)]
    for cache, r in FIRST_CALL.items():
        lines.append(f"first fused fwd+bwd in a fresh process ({cache} kernel cache): "
                     f"{r['first_call_s']:.2f} s (second call {1e3 * r['second_call_s']:.2f} ms)")
    out = Path(os.environ.get("KERNEL_BENCH_JSON", ".benchmarks/kernels.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    copies = kb.copy_bandwidth(rows)
    out.write_text(json.dumps({"device": where,
                               "copy_gbps": {f"{s}-{d}": g for (s, d), g in copies.items()},
                               "first_call": FIRST_CALL, "rows": rows}, indent=1))
    lines.append(f"rows written to {out}")
    return lines
