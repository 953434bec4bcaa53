"""`chunk-grpo gpu-check --out DIR` (``python -m chunk_grpo.gpu_check``): the acceptance check
of a machine with a CUDA GPU; its parts and report are `chunk_grpo.analysis.gpu_check`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PROG = "python -m chunk_grpo.gpu_check"


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    from chunk_grpo.analysis import gpu_check as check  # the standard library only

    parser = argparse.ArgumentParser(prog=prog, description=check.__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where report.json and report.md go")
    parser.add_argument("--config", type=Path, default=check.PRESET,
                        help="the preset of the preset_iteration part")
    parser.add_argument("--parts", default=",".join(check.PARTS),
                        help=f"comma-separated subset of {','.join(check.PARTS)}")
    args = parser.parse_args(argv)
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(check.PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {','.join(check.PARTS)}")
    import torch

    if not torch.cuda.is_available():
        sys.stderr.write(check.NO_CUDA.replace(PROG, prog, 1) + "\n")
        return 2
    if args.out is None:
        parser.error("--out DIR is required: where report.json and report.md go")
    args.out.mkdir(parents=True, exist_ok=True)
    functions = {"kernel_tests": check.kernel_tests, "kernel_bench": check.kernel_bench,
                 "preset_iteration": lambda out: check.preset_iteration(out, args.config),
                 "flash_attention": check.flash_attention}
    start = time.perf_counter()
    results = {}
    for name in chosen:
        print(f"[gpu_check] {name} ...", flush=True)
        results[name] = check.run_part(functions[name], args.out)
        print(f"[gpu_check] {name}: {results[name].status} ({results[name].seconds:.0f} s)",
              flush=True)
    report = check.build_report(results, check.environment(), time.perf_counter() - start)
    (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    table = check.format_report(report)
    (args.out / "report.md").write_text(table)
    print(table, end="")
    return report["exit_code"]
