"""Kernel benchmarks at FLUX shapes: forward, backward and full, each op and backend.

    OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_kernels.py
    OMP_NUM_THREADS=2 python -m pytest benchmarks/bench_kernels.py
    python -m pytest benchmarks/bench_kernels.py --device cuda

The cases and how they are measured live in `grpo_kernels.benchmark` (shared with
`python -m chunk_grpo.gpu_check`): [7, 2025, 64] is a chunk of 7 timesteps at 720x720;
[12, 4096, 64] a group of 12 at 1024x1024; [7, 64, 64] (sde_step_logprob, fp32) measures the
fixed per-call cost. `--device` (default: cuda when available) puts the tensors there; on CUDA
the rows are timed with CUDA events and their memory is `torch.cuda.max_memory_allocated`.
The eager torch reference is the baseline; the summary table gives the speed-up over it, the
effective GB/s (counted bytes / median time) beside the copy bandwidth measured in the same
run, and the peak extra memory in units of one input tensor. The CPU thread count comes from
OMP_NUM_THREADS (default 1: timings on shared cores swing wildly with more).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from kernel_bench_utils import FIRST_CALL, run_case

from grpo_kernels import benchmark as kb

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

BACKENDS = ["reference", "cpu_fused", "triton"]
# The FLUX shapes in both dtypes, plus a tiny one where the compute is negligible: its time
# is the fixed per-call cost (validation, coefficients, autograd, the kernel call).
LOGPROB_CASES = [(s, d) for s in kb.SHAPES for d in kb.DTYPES] + [(kb.TINY, torch.float32)]
_shape_id = lambda s: "x".join(map(str, s))  # noqa: E731


def _skip_unless_runs(backend: str, device: torch.device) -> None:
    if backend not in kb.backends(device):
        pytest.skip({"triton": "Triton kernels need a CUDA GPU (--device cuda); on the CPU "
                               "TRITON_INTERPRET=1 runs them ~1000x slower (a correctness "
                               "tool, tested in tests/, not benchmarked)",
                     "cpu_fused": "the fused C kernels take CPU tensors (--device cpu)",
                     }[backend])


@pytest.mark.parametrize("kind", ["copy_", "clone"])
@pytest.mark.parametrize("dtype", kb.DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", kb.SHAPES, ids=_shape_id)
def test_copy_bandwidth(benchmark, device, shape, dtype, kind):
    # The device's copy bandwidth for this tensor size: read + write = 2 x its bytes.
    run_case(benchmark, kb.copy_case(shape, dtype, device, kind), device)


@pytest.mark.parametrize("mode", ["forward", "backward", "full"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "shape, dtype", LOGPROB_CASES,
    ids=[_shape_id(s) + "-" + kb.dtype_name(d) for s, d in LOGPROB_CASES],
)
def test_sde_step_logprob(benchmark, device, shape, dtype, backend, mode):
    _skip_unless_runs(backend, device)
    run_case(benchmark, kb.logprob_case(shape, dtype, backend, mode, device), device)


@pytest.mark.parametrize("mode", ["forward", "full"])
@pytest.mark.parametrize("shape", [kb.SHAPES[0], kb.TINY], ids=_shape_id)
def test_sde_step_logprob_without_validation(benchmark, device, shape, mode):
    """The documented fast path: validate=False skips the value checks (on CUDA the one host
    sync per call). Its backend column reads "fast-path"; compare with the fused row."""
    backend = kb.backends(device)[1]
    run_case(benchmark, kb.logprob_case(shape, torch.float32, backend, mode, device,
                                        validate=False), device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", kb.DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", kb.SHAPES, ids=_shape_id)
def test_sde_step_sample(benchmark, device, shape, dtype, backend):
    _skip_unless_runs(backend, device)
    run_case(benchmark, kb.sample_case(shape, dtype, backend, device), device)


@pytest.mark.parametrize("impl", ["reference", "ode_step"])
@pytest.mark.parametrize("dtype", kb.DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", kb.SHAPES, ids=_shape_id)
def test_ode_step(benchmark, device, shape, dtype, impl):
    run_case(benchmark, kb.ode_case(shape, dtype, impl, device), device)


@pytest.mark.parametrize("mode", ["forward", "backward", "full"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", kb.LOSS_SHAPES, ids=_shape_id)
def test_chunk_grpo_loss(benchmark, device, shape, backend, mode):
    _skip_unless_runs(backend, device)
    run_case(benchmark, kb.loss_case(shape, backend, mode, device), device)


_FIRST_CALL = """
import sys, time, torch
torch.set_num_threads({threads})
import grpo_kernels as gk
shape = (7, 2025, 64)
x, v, xn = torch.randn(shape), torch.randn(shape, requires_grad=True), torch.randn(shape)
s = torch.linspace(0.95, 0.3, 7)
t = time.perf_counter()
torch.autograd.grad(gk.sde_step_logprob(x, v, xn, s, s - 0.05, eta=0.7).sum(), v)
first = time.perf_counter() - t
t = time.perf_counter()
torch.autograd.grad(gk.sde_step_logprob(x, v, xn, s, s - 0.05, eta=0.7).sum(), v)
print(first, time.perf_counter() - t)
"""


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_first_call_compile_cost(benchmark, tmp_path_factory, cache):
    """First fused forward+backward on the CPU in a fresh process: the C kernels are compiled
    with the system compiler and loaded. "cold" starts from an empty kernel cache (a fresh
    machine, CI), "warm" reuses the library the cold run just built (any later process)."""
    cache_dir = tmp_path_factory.getbasetemp() / "grpo-kernels-cache"
    env = dict(os.environ, GRPO_KERNELS_CACHE=str(cache_dir))
    code = _FIRST_CALL.format(threads=torch.get_num_threads())
    if cache == "warm" and not cache_dir.exists():
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    if cache == "cold" and cache_dir.exists():
        shutil.rmtree(cache_dir)
    result = {}

    def run():
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True)
        result["process_s"] = time.perf_counter() - start
        result["first_call_s"], result["second_call_s"] = map(float, out.stdout.split())

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(result, cache=cache, threads=torch.get_num_threads())
    FIRST_CALL[cache] = result
