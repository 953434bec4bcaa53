"""`python -m chunk_grpo.gpu_check --out DIR`: the acceptance check of a machine with a CUDA GPU.

About 10 minutes on one 80 GB GPU. Four parts, each with its own status (pass, fail, or skipped
with the reason), so one failing part hides nothing of the others:

1. kernel_tests: tests/unit/kernels/test_kernels_cuda.py under pytest in a subprocess
   (TRITON_INTERPRET=0): the compiled Triton kernels against the torch reference in fp32 and bf16,
   forward and backward, at FLUX shapes;
2. kernel_bench: the kernel benchmark on the GPU (`grpo_kernels.benchmark`, the cases of
   benchmarks/bench_kernels.py): CUDA-event times, `max_memory_allocated`, GB/s against eager
   torch and against a device-to-device copy of the same bytes;
3. preset_iteration: one iteration of configs/flux_dev_hpsv3.yaml on a FLUX.1-dev-width model
   (`chunk_grpo.analysis.gpu_check_preset`, in its own process under a 1-rank NCCL group): the
   measured peak against the memory plan of that exact config, seconds per phase, host syncs;
4. flash_attention: FlashAttention against native attention
   (`chunk_grpo.analysis.gpu_check_attention`), skipped when flash-attn is not installed.

It writes DIR/report.json and DIR/report.md (the table it also prints). Exit status: 0 when
every part that ran passed, 1 otherwise, 2 without CUDA (one line on stderr).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CUDA_TESTS = REPO / "tests" / "unit" / "kernels" / "test_kernels_cuda.py"
PRESET = REPO / "configs" / "flux_dev_hpsv3.yaml"
PARTS = ("kernel_tests", "kernel_bench", "preset_iteration", "flash_attention")
PLAN_TOLERANCE = 0.15  # the plan's allocator peak within 15% of the measured one
TIMEOUTS = {"kernel_tests": 240, "preset_iteration": 420}  # seconds; the whole check <= 10 min
NO_CUDA = ("python -m chunk_grpo.gpu_check: CUDA is not available (no GPU visible, or a CPU-only "
           "torch); this command is the acceptance check of a CUDA machine (compiled Triton "
           "kernels, their benchmark, one FLUX.1-dev-width preset iteration, FlashAttention): "
           "run it where a GPU is")


@dataclass
class PartResult:
    """One part's outcome: status pass | fail | skipped, why, and its numbers."""

    status: str
    reason: str = ""
    summary: str = ""  # one line for the table
    seconds: float = 0.0
    details: dict = field(default_factory=dict)


def run_part(fn: Callable[[Path], PartResult], out: Path) -> PartResult:
    """Run one part; an exception fails it (the reason in one line, the traceback kept)."""
    start = time.perf_counter()
    try:
        result = fn(out)
    except Exception as err:
        result = PartResult("fail", f"{type(err).__name__}: {' '.join(str(err).split())}"[:500],
                            details={"traceback": traceback.format_exc()[-6000:]})
    result.seconds = time.perf_counter() - start
    return result


# ----------------------------------------------------------------------------- the parts

def kernel_tests(out: Path) -> PartResult:
    if not CUDA_TESTS.is_file():
        return PartResult("skipped", f"{CUDA_TESTS} not found: run from a source checkout")
    xml, log = out / "kernel_tests.xml", out / "kernel_tests.log"
    command = [sys.executable, "-m", "pytest", "-m", "cuda", str(CUDA_TESTS), "-q",
               "-p", "no:cacheprovider", f"--junitxml={xml}"]
    env = dict(os.environ, TRITON_INTERPRET="0")  # the compiled kernels, not the interpreter
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUTS["kernel_tests"])
    log.write_text(proc.stdout + proc.stderr)
    counts = junit_counts(xml) if xml.is_file() else {"passed": 0, "failed": 0, "errors": 0,
                                                      "skipped": 0, "failures": []}
    counts["log"] = log.name
    ok = proc.returncode == 0 and counts["passed"] > 0 and not counts["skipped"]
    reason = "" if ok else (f"pytest exit {proc.returncode}: {counts['failed']} failed, "
                            f"{counts['errors']} errors, {counts['skipped']} skipped "
                            f"(see {log.name})")
    summary = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
               f"{counts['skipped']} skipped")
    return PartResult("pass" if ok else "fail", reason, summary, details=counts)


def junit_counts(xml: Path) -> dict:
    """Passed / failed / errors / skipped and the failing test ids of a pytest JUnit XML file."""
    root = ET.parse(xml).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for case in root.iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(kind, "passed")
        counts[key] += 1
        if kind in ("failure", "error"):
            counts["failures"].append(f"{case.get('classname')}::{case.get('name')}")
    return counts


def kernel_bench(out: Path) -> PartResult:
    import torch

    from grpo_kernels import benchmark as kb

    rows = kb.run_suite(torch.device("cuda"))
    slower = [f"{r['op']} {r['mode']} {r['backend']} {'x'.join(map(str, r['shape']))} "
              f"{r['dtype']}: {r['vs_reference']:.2f}x eager" for r in rows
              if r["backend"] in ("triton", "fast-path") and r["vs_reference"]
              and r["vs_reference"] < 1]
    fused = [r for r in rows if r["backend"] == "triton" and r["of_copy"]]
    best = max(fused, key=lambda r: r["of_copy"], default=None)
    summary = f"{len(rows)} rows"
    if best is not None:
        summary += (f"; best Triton {best['gbps']:.0f} GB/s = {100 * best['of_copy']:.0f}% of "
                    f"the copy ({best['op']} {best['mode']} {best['dtype']})")
    summary += f"; {len(slower)} fused rows slower than eager torch"
    (out / "kernel_bench.txt").write_text("\n".join(kb.format_rows(rows)) + "\n")
    copies = {f"{'x'.join(map(str, s))}-{d}": g for (s, d), g in kb.copy_bandwidth(rows).items()}
    return PartResult("pass", "", summary, details={"copy_gbps": copies,
                                                   "slower_than_eager": slower, "rows": rows})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def preset_iteration(out: Path, config: Path = PRESET) -> PartResult:
    if not config.is_file():
        return PartResult("skipped", f"{config} not found: run from a source checkout or pass "
                                     f"--config")
    work = out / "preset"
    # A 1-rank NCCL group from the environment, as torchrun would set it up.
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    command = [sys.executable, "-m", "chunk_grpo.analysis.gpu_check_preset", "--out", str(work),
               "--config", str(config)]
    log = out / "preset_iteration.log"
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=TIMEOUTS["preset_iteration"])
        log.write_text(proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired as err:
        log.write_text(f"{err.stdout or ''}{err.stderr or ''}")
        return PartResult("fail", f"did not finish in {TIMEOUTS['preset_iteration']} s (see "
                                  f"{log.name})")
    result_file = work / "result.json"
    if not result_file.is_file():
        tail = " ".join((proc.stderr or "").strip().splitlines()[-1:])
        return PartResult("fail", f"exit {proc.returncode} before a result: {tail} (see "
                                  f"{log.name})")
    return preset_verdict(json.loads(result_file.read_text()))


def preset_verdict(result: dict) -> PartResult:
    """Pass when the run finished, its iteration's peak does not exceed the plan's and the
    plan is within PLAN_TOLERANCE of it (the allocator's view: the plan's fixed allowance for
    the CUDA context is outside max_memory_allocated)."""
    summary = result.get("summary", "")
    if result.get("status") != "pass":
        return PartResult("fail", result.get("error", "the run failed"), summary, details=result)
    diff = result.get("plan_vs_measured")
    if diff is None:
        return PartResult("fail", "no iteration was measured", summary, details=result)
    if diff < 0:
        reason = f"the plan under-predicts the iteration's peak by {-100 * diff:.0f}%"
    elif diff > PLAN_TOLERANCE:
        reason = f"the plan over-predicts the iteration's peak by {100 * diff:.0f}%"
    else:
        reason = ""
    return PartResult("fail" if reason else "pass", reason, summary, details=result)


def flash_attention(out: Path) -> PartResult:
    from chunk_grpo.analysis.gpu_check_attention import check

    status, reason, details = check()
    rows = details.get("cases", [])
    summary = "; ".join(f"batch {r['shape'][0]}: flash {r['flash_full_ms']:.2f} ms vs native "
                        f"{r['native_full_ms']:.2f} ms fwd+bwd, error {r['max_error']['flash']:.2g}"
                        f" (native {r['max_error']['native']:.2g})" for r in rows)
    return PartResult(status, reason, summary, details=details)


# ----------------------------------------------------------------------------- the report

def exit_code(results: dict[str, PartResult]) -> int:
    """0 when every part that ran passed (skipped parts do not count), 1 otherwise."""
    return 0 if all(r.status in ("pass", "skipped") for r in results.values()) else 1


def build_report(results: dict[str, PartResult], environment: dict, seconds: float) -> dict:
    code = exit_code(results)
    return {"status": "pass" if code == 0 else "fail", "exit_code": code,
            "seconds": seconds, "environment": environment,
            "parts": {name: asdict(r) for name, r in results.items()}}


def format_report(report: dict) -> str:
    """The short table: one row per part, the reasons of those that did not pass below it."""
    env = report["environment"]
    lines = [f"# GPU check: {report['status']} ({report['seconds']:.0f} s)", "",
             f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}"
             f", triton {env.get('triton', '?')}, commit {env.get('commit', '?')}", "",
             "| part | status | seconds | result |", "|---|---|---:|---|"]
    for name, part in report["parts"].items():
        text = part["summary"] or part["reason"]
        lines.append(f"| {name} | {part['status']} | {part['seconds']:.0f} | {text} |")
    notes = [f"- {name}: {p['reason']}" for name, p in report["parts"].items() if p["reason"]]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def environment() -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip() or None
    return {"gpu": props.name, "gpu_memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton_version, "commit": commit,
            "python": sys.version.split()[0],
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}
