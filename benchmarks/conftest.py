"""Collect `bench_*.py` files (pytest only collects test_*.py by default) and print a summary.

Run: `OMP_NUM_THREADS=1 python -m pytest benchmarks/` (and again with 2 threads). Not part of
CI's `pytest`, whose testpaths is `tests`.
"""

import pytest


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
