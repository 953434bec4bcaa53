"""`python -m chunk_grpo.gpu_check` where there is no GPU: its one-line exit, its report logic on
made-up part results, its CUDA tests collected and skipped, and the kernel benchmark's device
plumbing on the CPU (`grpo_kernels.benchmark`, which it shares with benchmarks/)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chunk_grpo.analysis import gpu_check as gc
from chunk_grpo.analysis.gpu_check_preset import SyncCounter, phase_memory_peaks
from chunk_grpo.cli import gpu_check as gpu_check_cli
from grpo_kernels import benchmark as kb

REPO = Path(__file__).resolve().parents[3]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


@no_cuda
@pytest.mark.parametrize("args", [[], ["--out", "report-dir"]])
def test_without_cuda_one_line_and_exit_2(tmp_path, args):
    result = subprocess.run([sys.executable, "-m", "chunk_grpo.gpu_check", *args], cwd=tmp_path,
                            capture_output=True, text=True, env=dict(os.environ))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "CUDA is not available" in lines[0] and "acceptance check" in lines[0]
    assert not (tmp_path / "report-dir").exists()  # nothing written


def test_unknown_part_is_one_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check_cli.main(["--out", "x", "--parts", "kernel_tests,warp_drive"])
    assert exit_info.value.code == 2
    assert "unknown part(s) ['warp_drive']" in capsys.readouterr().err


def _results(**statuses):
    return {name: gc.PartResult(status, "why" if status != "pass" else "", f"{name} numbers",
                                1.5, {"n": 1}) for name, status in statuses.items()}


@pytest.mark.parametrize("statuses, code", [
    (dict(kernel_tests="pass", kernel_bench="pass", preset_iteration="pass",
          flash_attention="pass"), 0),
    (dict(kernel_tests="pass", kernel_bench="pass", preset_iteration="pass",
          flash_attention="skipped"), 0),
    (dict(kernel_tests="fail", kernel_bench="pass", preset_iteration="pass",
          flash_attention="skipped"), 1),
    (dict(kernel_tests="pass", kernel_bench="pass", preset_iteration="fail",
          flash_attention="pass"), 1),
])
def test_exit_code_counts_only_the_parts_that_ran(statuses, code):
    results = _results(**statuses)
    assert gc.exit_code(results) == code
    report = gc.build_report(results, {"gpu": "H100"}, 12.0)
    assert report["exit_code"] == code and report["status"] == ("pass" if code == 0 else "fail")
    assert list(report["parts"]) == list(statuses)
    part = report["parts"]["kernel_bench"]
    assert part == {"status": "pass", "reason": "", "summary": "kernel_bench numbers",
                    "seconds": 1.5, "details": {"n": 1}}
    json.dumps(report)  # serialisable as it is


def test_report_table_has_a_row_per_part_and_the_reasons():
    results = _results(kernel_tests="fail", kernel_bench="pass", preset_iteration="pass",
                       flash_attention="skipped")
    text = gc.format_report(gc.build_report(results, {"gpu": "H100", "torch": "2.x"}, 30.0))
    assert text.startswith("# GPU check: fail (30 s)")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["part", *gc.PARTS]
    assert "| kernel_tests | fail | 2 | kernel_tests numbers |" in text
    assert "- kernel_tests: why" in text and "- flash_attention: why" in text
    assert "- kernel_bench" not in text


def test_a_part_that_raises_fails_alone_with_a_one_line_reason(tmp_path):
    def broken(out):
        raise RuntimeError("CUDA error: out of memory\nmore detail")

    result = gc.run_part(broken, tmp_path)
    assert result.status == "fail"
    assert result.reason == "RuntimeError: CUDA error: out of memory more detail"
    assert "Traceback" in result.details["traceback"]
    assert gc.run_part(lambda out: gc.PartResult("pass"), tmp_path).status == "pass"


def _preset_result(measured_gb, plan_gb, status="pass"):
    gb = 1e9
    return {"status": status, "error": "OutOfMemoryError: boom", "summary": "s",
            "iteration_peak_bytes": measured_gb * gb,
            "plan": {"allocator_peak_bytes": plan_gb * gb},
            "plan_vs_measured": (plan_gb - measured_gb) / measured_gb}


@pytest.mark.parametrize("measured, plan, status, reason", [
    (20.0, 21.0, "pass", ""),
    (20.0, 20.0, "pass", ""),
    (20.0, 18.0, "fail", "the plan under-predicts the iteration's peak by 10%"),
    (20.0, 26.0, "fail", "the plan over-predicts the iteration's peak by 30%"),
])
def test_preset_verdict_compares_the_plan_with_the_measured_peak(measured, plan, status, reason):
    verdict = gc.preset_verdict(_preset_result(measured, plan))
    assert (verdict.status, verdict.reason) == (status, reason)


def test_preset_verdict_of_a_failed_run_names_its_error():
    verdict = gc.preset_verdict(_preset_result(20.0, 21.0, status="fail"))
    assert (verdict.status, verdict.reason) == ("fail", "OutOfMemoryError: boom")
    assert gc.preset_verdict({"status": "pass"}).reason == "no iteration was measured"


def test_junit_counts(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_kernels_cuda" name="test_a"/>'
        '<testcase classname="tests.test_kernels_cuda" name="test_b"><failure message="x"/>'
        '</testcase><testcase classname="t" name="test_c"><skipped message="y"/></testcase>'
        '<testcase classname="t" name="test_d"><error message="z"/></testcase>'
        '</testsuite></testsuites>')
    assert gc.junit_counts(xml) == {
        "passed": 1, "failed": 1, "errors": 1, "skipped": 1,
        "failures": ["tests.test_kernels_cuda::test_b", "t::test_d"]}


def test_cuda_tests_are_collected_and_skipped_here(tmp_path):
    # --strict-markers: the `cuda` marker is registered (pyproject.toml).
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the tests would run")
    xml = tmp_path / "r.xml"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda",
         str(REPO / "tests/unit/kernels/test_kernels_cuda.py"),
         "-q", "-p", "no:cacheprovider", "--strict-markers", f"--junitxml={xml}"],
        cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:]
    counts = gc.junit_counts(xml)
    assert counts["skipped"] > 50 and counts["passed"] == counts["failed"] == 0


def test_sync_counter_groups_sync_warnings_by_site_and_passes_others_on():
    counter = SyncCounter()
    passed = []
    counter.fallback = lambda *args: passed.append(args[0])
    for line in (10, 10, 12):
        counter.showwarning("called a synchronizing CUDA operation", UserWarning,
                            "/x/torch/_tensor.py", line)
    counter.showwarning("something else", UserWarning, "/x/y.py", 1)
    summary = counter.to_dict()
    assert summary["count"] == 3 and passed == ["something else"]
    assert summary["top"][0] == {"site": "outside the project", "warned_at": "torch/_tensor.py:10",
                                 "count": 2}


def test_phase_memory_is_used_only_when_its_module_exists():
    records = [{"time/rollout": 1.0, "memory/rollout": 5e9}]
    if importlib.util.find_spec("chunk_grpo.train.phase_memory") is None:
        assert phase_memory_peaks(records) is None
    else:
        assert phase_memory_peaks(records) == {"memory/rollout": 5e9}


def test_kernel_benchmark_runs_on_the_cpu_device():
    rows = kb.run_suite("cpu", shapes=[(2, 8, 4)], dtypes=[torch.float32, torch.bfloat16],
                        tiny=None, loss_shapes=[(3, 16)], rounds=2, warmup=1)
    backends = {r["backend"] for r in rows}
    assert backends == {"torch", "reference", "cpu_fused", "fast-path", "ode_step"}
    assert {r["device"] for r in rows} == {"cpu"}
    for r in rows:
        assert r["median_ms"] > 0 and r["gbps"] > 0 and r["peak_extra_bytes"] >= 0, r
        if r["op"] != "chunk_grpo_loss":
            assert r["of_copy"] is not None, r  # latent-sized rows sit beside their copy
    fused = [r for r in rows if r["backend"] == "cpu_fused"]
    assert fused and all(r["vs_reference"] is not None for r in fused)
    lines = kb.format_rows(rows)
    assert len(lines) == 1 + len(rows) + 2  # header, rows, one copy line per dtype


def test_benchmark_tensors_live_on_the_given_device():
    meta = torch.device("meta")
    assert all(t.device == meta for t in kb.latents((2, 8, 4), torch.bfloat16, meta))
    assert kb.backends(torch.device("cuda")) == ["reference", "triton"]
    assert kb.backends(torch.device("cpu")) == ["reference", "cpu_fused"]


def test_flash_attention_is_skipped_with_the_install_hint_when_absent():
    from chunk_grpo.analysis.gpu_check_attention import check

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed")
    status, reason, details = check()
    assert (status, details) == ("skipped", {})
    assert "--no-build-isolation" in reason
