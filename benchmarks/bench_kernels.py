"""Kernel benchmarks at FLUX shapes: forward, backward and full, each op and backend.

    OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_kernels.py
    OMP_NUM_THREADS=2 python -m pytest benchmarks/bench_kernels.py

[7, 2025, 64] is a chunk of 7 timesteps at 720x720; [12, 4096, 64] a group of 12 at 1024x1024;
[7, 64, 64] (sde_step_logprob, fp32) measures the fixed per-call cost.
The eager torch reference is the baseline; the summary table gives the speed-up over it, the
effective GB/s (counted bytes / median time) beside the copy bandwidth measured in the same
run, and the peak extra memory in units of one input tensor. The thread count comes from
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
from kernel_bench_utils import COPY_GBPS, FIRST_CALL, peak_extra_bytes, record

import grpo_kernels as gk

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

SHAPES = [(7, 2025, 64), (12, 4096, 64)]
TINY = (7, 64, 64)
DTYPES = [torch.float32, torch.bfloat16]
BACKENDS = ["reference", "cpu_fused", "triton"]
LOSS_SHAPES = [(12, 16), (96, 16)]  # one group of 12 / eight groups, 16 trained steps
CHUNKS = [2, 3, 4, 7]
ROUNDS = dict(rounds=20, warmup_rounds=3, iterations=1)


def _skip_triton(backend: str) -> None:
    if backend == "triton" and not torch.cuda.is_available():
        pytest.skip("Triton kernels need a CUDA GPU; on the CPU TRITON_INTERPRET=1 runs them "
                    "~1000x slower (a correctness tool, tested in tests/, not benchmarked)")


def _latents(shape, dtype, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    x, v, e = (torch.randn(shape, generator=g).to(dtype) for _ in range(3))
    batch = shape[0]
    sigma = torch.linspace(0.95, 0.3, batch)
    sigma_next = sigma - 0.05
    x_next = (x.float() + (sigma_next - sigma).view(-1, 1, 1) * v.float() + 0.1 * e).to(dtype)
    return x, v.requires_grad_(requires_grad), x_next, e, sigma, sigma_next


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("kind", ["copy_", "clone"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_copy_bandwidth(benchmark, shape, dtype, kind):
    # The machine's copy bandwidth for this tensor size: read + write = 2 x its bytes.
    # "copy_" writes into a preallocated tensor (pure bandwidth: the stricter yardstick, used
    # for "% copy"); "clone" also allocates, like an op that returns a new tensor.
    x = _latents(shape, dtype)[0]
    out = torch.empty_like(x)
    fn = x.clone if kind == "clone" else lambda: out.copy_(x)
    benchmark.pedantic(fn, **ROUNDS)
    row = record(benchmark, op="copy", mode=kind, backend="torch", shape=shape, dtype=dtype,
                 counted_bytes=2 * _bytes(x), input_bytes=_bytes(x), peak=peak_extra_bytes(fn))
    if kind == "copy_":
        COPY_GBPS[(tuple(shape), row["dtype"])] = row["gbps"]


# The FLUX shapes in both dtypes, plus a tiny one where the compute is negligible: its time
# is the fixed per-call cost (validation, coefficients, autograd, the ctypes call).
LOGPROB_CASES = [(shape, dtype) for shape in SHAPES for dtype in DTYPES] + [(TINY, torch.float32)]


@pytest.mark.parametrize("mode", ["forward", "backward", "full"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "shape, dtype", LOGPROB_CASES,
    ids=["x".join(map(str, s)) + "-" + str(d).split(".")[-1] for s, d in LOGPROB_CASES],
)
def test_sde_step_logprob(benchmark, shape, dtype, backend, mode):
    _skip_triton(backend)
    x, v, x_next, _, sigma, sigma_next = _latents(shape, dtype, requires_grad=mode != "forward")

    def forward():
        return gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=0.7, backend=backend)

    def full():
        return torch.autograd.grad(forward().sum(), v)

    if mode == "backward":
        # Time the backward alone: a fresh forward graph per round, built outside the timer.
        grad_out = torch.ones(shape[0])
        setup = lambda: ((forward(),), {})  # noqa: E731
        target = lambda logp: torch.autograd.grad(logp, v, grad_out)  # noqa: E731
        benchmark.pedantic(target, setup=setup, rounds=20, warmup_rounds=3)
        logp = forward()
        peak = peak_extra_bytes(lambda: target(logp))
    else:
        fn = full if mode == "full" else forward
        benchmark.pedantic(fn, **ROUNDS)
        peak = peak_extra_bytes(fn)
    # Counted bytes: the forward reads x, v, x' once; the backward reads them again and
    # writes grad_v (the mean is never stored, so nothing else has to move).
    n = _bytes(x)
    counted = {"forward": 3 * n, "backward": 4 * n, "full": 7 * n}[mode]
    record(benchmark, op="sde_step_logprob", mode=mode, backend=backend, shape=shape,
           dtype=dtype, counted_bytes=counted, input_bytes=n, peak=peak)


@pytest.mark.parametrize("mode", ["forward", "full"])
@pytest.mark.parametrize("shape", [SHAPES[0], TINY], ids=lambda s: "x".join(map(str, s)))
def test_sde_step_logprob_without_validation(benchmark, shape, mode):
    """The documented fast path: validate=False skips the value checks (on CUDA the one host
    sync per call). Its backend column reads "fast-path"; compare with the cpu_fused row."""
    x, v, x_next, _, sigma, sigma_next = _latents(shape, torch.float32, mode == "full")

    def forward():
        return gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=0.7,
                                   backend="cpu_fused", validate=False)

    fn = (lambda: torch.autograd.grad(forward().sum(), v)) if mode == "full" else forward
    benchmark.pedantic(fn, **ROUNDS)
    n = _bytes(x)
    record(benchmark, op="sde_step_logprob", mode=mode, backend="fast-path", shape=shape,
           dtype=torch.float32, counted_bytes={"forward": 3 * n, "full": 7 * n}[mode],
           input_bytes=n, peak=peak_extra_bytes(fn))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sde_step_sample(benchmark, shape, dtype, backend):
    _skip_triton(backend)
    x, v, _, noise, sigma, sigma_next = _latents(shape, dtype)

    def sample():
        return gk.sde_step_sample(x, v, noise, sigma, sigma_next, eta=0.7, backend=backend)

    benchmark.pedantic(sample, **ROUNDS)
    # Counted: read x, v, eps, write x'. (The logp is then recomputed from the stored x',
    # another read of x, v, x', so it is bit-identical to sde_step_logprob's: not counted.)
    n = _bytes(x)
    record(benchmark, op="sde_step_sample", mode="forward", backend=backend, shape=shape,
           dtype=dtype, counted_bytes=4 * n, input_bytes=n, peak=peak_extra_bytes(sample))


@pytest.mark.parametrize("impl", ["reference", "ode_step"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_ode_step(benchmark, shape, dtype, impl):
    x, v, _, _, sigma, sigma_next = _latents(shape, dtype)
    dt = (sigma_next - sigma).view(-1, 1, 1)
    if impl == "reference":
        fn = lambda: (x.float() + dt * v.float()).to(dtype)  # noqa: E731
    else:
        fn = lambda: gk.ode_step(x, v, sigma, sigma_next)  # noqa: E731
    benchmark.pedantic(fn, **ROUNDS)
    n = _bytes(x)
    record(benchmark, op="ode_step", mode="forward", backend=impl, shape=shape, dtype=dtype,
           counted_bytes=3 * n, input_bytes=n, peak=peak_extra_bytes(fn))


@pytest.mark.parametrize("mode", ["forward", "backward", "full"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", LOSS_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_chunk_grpo_loss(benchmark, shape, backend, mode):
    _skip_triton(backend)
    g = torch.Generator().manual_seed(0)
    logp_old = torch.randn(shape, generator=g)
    logp_new = (logp_old + 0.01 * torch.randn(shape, generator=g)).requires_grad_()
    advantages = torch.randn(shape[0], generator=g)

    def forward():
        return gk.chunk_grpo_loss(logp_new, logp_old, advantages, CHUNKS, clip_low=1e-3,
                                  clip_high=1e-3, kl_coef=0.01, backend=backend)[0]

    def full():
        return torch.autograd.grad(forward(), logp_new)

    if mode == "backward":
        setup = lambda: ((forward(),), {})  # noqa: E731
        target = lambda loss: torch.autograd.grad(loss, logp_new)  # noqa: E731
        benchmark.pedantic(target, setup=setup, rounds=50, warmup_rounds=5)
        loss = forward()
        peak = peak_extra_bytes(lambda: target(loss))
    else:
        fn = full if mode == "full" else forward
        benchmark.pedantic(fn, rounds=50, warmup_rounds=5, iterations=1)
        peak = peak_extra_bytes(fn)
    n = _bytes(logp_old)  # reads logp_new, logp_old (+ advantages); writes grad_logp_new
    counted = {"forward": 2 * n, "backward": n, "full": 3 * n}[mode]
    record(benchmark, op="chunk_grpo_loss", mode=mode, backend=backend, shape=shape,
           dtype=torch.float32, counted_bytes=counted, input_bytes=n, peak=peak)


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
    """First fused forward+backward in a fresh process: the C kernels are compiled with the
    system compiler and loaded. "cold" starts from an empty kernel cache (a fresh machine, CI),
    "warm" reuses the library the cold run just built (any later process)."""
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
