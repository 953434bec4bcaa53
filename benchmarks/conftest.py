"""Collect `bench_*.py` files (pytest only collects test_*.py by default) and print a summary.

Run: `OMP_NUM_THREADS=1 python -m pytest benchmarks/` (and again with 2 threads). Not part of
CI's `pytest`, whose testpaths is `tests`. `--device cpu|cuda` chooses where the kernel
benchmarks put their tensors (default: cuda when available).
"""

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--device", default=None, choices=["cpu", "cuda"],
                     help="device of the kernel benchmarks' tensors (default: cuda if available)")


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    name = request.config.getoption("--device")
    name = name or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: CUDA is not available (no GPU visible, or a "
                                "CPU-only torch)")
    return torch.device(name)


def pytest_collect_file(file_path, parent):
    # A file named on the command line is collected by pytest itself: don't add it twice.
    if parent.session.isinitpath(file_path):
        return None
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_terminal_summary(terminalreporter):
    try:
        from kernel_bench_utils import summary_lines
    except ImportError:  # kernel benchmarks were not collected
        return
    lines = summary_lines()
    if lines:
        terminalreporter.section("kernel benchmarks: time, memory, bandwidth")
        for line in lines:
            terminalreporter.write_line(line)
