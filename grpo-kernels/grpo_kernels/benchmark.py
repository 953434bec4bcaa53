"""Measuring the kernels: the benchmark cases at FLUX shapes and how they are timed, on any device.

Shared by `benchmarks/bench_kernels.py` (pytest-benchmark) and `python -m chunk_grpo.gpu_check`.

A `Case` is one call to time (forward, backward or forward + backward of one op on one backend)
with the bytes it must move by design ("counted bytes", documented per op). `measure` times it:
on CUDA with CUDA events around each call, the L2 cache flushed before each round (FLUX-sized
tensors fit in an H100's 50 MB L2, which would flatter a second read), peak memory from
`torch.cuda.max_memory_allocated`; on the CPU with `time.perf_counter`, peak memory from the
torch profiler's allocator records (tracemalloc does not see torch's allocator). Effective GB/s
is counted bytes / median time; the yardstick is a device-to-device copy of one input into a
preallocated tensor (read + write = 2 x its bytes) timed the same way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

import grpo_kernels as gk

# [7, 2025, 64]: a chunk of 7 timesteps at 720x720; [12, 4096, 64]: a group of 12 at 1024x1024.
SHAPES = [(7, 2025, 64), (12, 4096, 64)]
TINY = (7, 64, 64)  # the fixed per-call cost (validation, coefficients, autograd, the launch)
DTYPES = [torch.float32, torch.bfloat16]
LOSS_SHAPES = [(12, 16), (96, 16)]  # one group of 12 / eight groups, 16 trained steps
CHUNKS = [2, 3, 4, 7]
ETA = 0.7
L2_FLUSH_BYTES = 256 * 2**20


@dataclass
class Case:
    """One timed call: ``fn(*setup())`` (setup runs outside the timer; None = no arguments)."""

    op: str
    mode: str  # forward | backward | full
    backend: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    counted_bytes: int
    input_bytes: int
    fn: Callable
    setup: Callable[[], tuple] | None = None
    rounds: int = 20
    warmup: int = 3

    def args(self) -> tuple:
        return self.setup() if self.setup is not None else ()


def backends(device: torch.device) -> list[str]:
    """The backends that run on ``device``: eager torch ("reference") and the fused one."""
    return ["reference", "triton"] if device.type == "cuda" else ["reference", "cpu_fused"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def latents(shape, dtype, device, requires_grad=False):
    """(x, v, x_next, noise, sigma, sigma_next) on ``device``, the same values on every device."""
    g = torch.Generator().manual_seed(0)
    x, v, e = (torch.randn(shape, generator=g) for _ in range(3))
    sigma = torch.linspace(0.95, 0.3, shape[0])
    sigma_next = sigma - 0.05
    dt = (sigma_next - sigma).view(-1, *[1] * (len(shape) - 1))
    x_next = x + dt * v + 0.1 * e
    x, v, x_next, e = (t.to(device=device, dtype=dtype) for t in (x, v, x_next, e))
    return (x, v.requires_grad_(requires_grad), x_next, e, sigma.to(device),
            sigma_next.to(device))


def copy_case(shape, dtype, device, kind: str = "copy_") -> Case:
    """"copy_" writes into a preallocated tensor (pure bandwidth: the yardstick); "clone" also
    allocates, like an op that returns a new tensor."""
    x = latents(shape, dtype, device)[0]
    out = torch.empty_like(x)
    fn = x.clone if kind == "clone" else (lambda: out.copy_(x))
    n = _nbytes(x)
    return Case("copy", kind, "torch", tuple(shape), dtype, 2 * n, n, fn)


def logprob_case(shape, dtype, backend, mode, device, *, validate: bool = True) -> Case:
    """sde_step_logprob. Counted bytes: the forward reads x, v, x' once; the backward reads them
    again and writes grad_v (the mean is never stored, so nothing else has to move)."""
    x, v, x_next, _, sigma, sigma_next = latents(shape, dtype, device, mode != "forward")

    def forward():
        return gk.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=ETA, backend=backend,
                                   validate=validate)

    n = _nbytes(x)
    counted = {"forward": 3 * n, "backward": 4 * n, "full": 7 * n}[mode]
    name = backend if validate else "fast-path"
    case = Case("sde_step_logprob", mode, name, tuple(shape), dtype, counted, n, forward)
    if mode == "full":
        case.fn = lambda: torch.autograd.grad(forward().sum(), v)
    elif mode == "backward":
        # The backward alone: a fresh forward graph per round, built outside the timer.
        grad_out = torch.ones(shape[0], device=device)
        case.setup = lambda: (forward(),)
        case.fn = lambda logp: torch.autograd.grad(logp, v, grad_out)
    return case


def sample_case(shape, dtype, backend, device) -> Case:
    """sde_step_sample. Counted: read x, v, eps, write x'. (The logp is then recomputed from
    the stored x', another read of x, v, x', so it is bit-identical to sde_step_logprob's: not
    counted.)"""
    x, v, _, noise, sigma, sigma_next = latents(shape, dtype, device)
    n = _nbytes(x)
    return Case("sde_step_sample", "forward", backend, tuple(shape), dtype, 4 * n, n,
                lambda: gk.sde_step_sample(x, v, noise, sigma, sigma_next, eta=ETA,
                                           backend=backend))


def ode_case(shape, dtype, impl, device) -> Case:
    """ode_step against its eager expression. Counted: read x, v, write x'."""
    x, v, _, _, sigma, sigma_next = latents(shape, dtype, device)
    dt = (sigma_next - sigma).view(-1, 1, 1)
    if impl == "reference":
        fn = lambda: (x.float() + dt * v.float()).to(dtype)  # noqa: E731
    else:
        fn = lambda: gk.ode_step(x, v, sigma, sigma_next)  # noqa: E731
    n = _nbytes(x)
    return Case("ode_step", "forward", impl, tuple(shape), dtype, 3 * n, n, fn)


def loss_case(shape, backend, mode, device) -> Case:
    """chunk_grpo_loss with the preset's chunks. Counted: reads logp_new, logp_old (+ the
    advantages); the backward writes grad_logp_new."""
    g = torch.Generator().manual_seed(0)
    logp_old = torch.randn(shape, generator=g)
    logp_new = logp_old + 0.01 * torch.randn(shape, generator=g)
    advantages = torch.randn(shape[0], generator=g)
    logp_old, advantages = logp_old.to(device), advantages.to(device)
    logp_new = logp_new.to(device).requires_grad_()

    def forward():
        return gk.chunk_grpo_loss(logp_new, logp_old, advantages, CHUNKS, clip_low=1e-3,
                                  clip_high=1e-3, kl_coef=0.01, backend=backend)[0]

    n = _nbytes(logp_old)
    counted = {"forward": 2 * n, "backward": n, "full": 3 * n}[mode]
    case = Case("chunk_grpo_loss", mode, backend, tuple(shape), torch.float32, counted, n,
                forward, rounds=50, warmup=5)
    if mode == "full":
        case.fn = lambda: torch.autograd.grad(forward(), logp_new)
    elif mode == "backward":
        case.setup = lambda: (forward(),)
        case.fn = lambda loss: torch.autograd.grad(loss, logp_new)
    return case


def suite(device: torch.device, *, shapes: Sequence[tuple] = SHAPES,
          dtypes: Sequence[torch.dtype] = DTYPES, tiny: tuple | None = TINY,
          loss_shapes: Sequence[tuple] = LOSS_SHAPES) -> Iterator[Case]:
    """Every case of the kernel benchmark on ``device``, the copy yardsticks first."""
    device = torch.device(device)
    for shape in shapes:
        for dtype in dtypes:
            yield copy_case(shape, dtype, device)
    logprob = [(s, d) for s in shapes for d in dtypes] + ([(tiny, torch.float32)] if tiny else [])
    for shape, dtype in logprob:
        for backend in backends(device):
            for mode in ("forward", "backward", "full"):
                yield logprob_case(shape, dtype, backend, mode, device)
        for mode in ("forward", "full"):
            yield logprob_case(shape, dtype, backends(device)[1], mode, device, validate=False)
    for shape in shapes:
        for dtype in dtypes:
            for backend in backends(device):
                yield sample_case(shape, dtype, backend, device)
            for impl in ("reference", "ode_step"):
                yield ode_case(shape, dtype, impl, device)
    for shape in loss_shapes:
        for backend in backends(device):
            for mode in ("forward", "backward", "full"):
                yield loss_case(shape, backend, mode, device)


# ----------------------------------------------------------------------------- measuring

def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(case: Case, device: torch.device, rounds: int | None = None,
              warmup: int | None = None) -> list[float]:
    """Seconds of each timed round of ``case``: CUDA events on CUDA, perf_counter elsewhere."""
    device = torch.device(device)
    rounds = rounds or case.rounds
    for _ in range(case.warmup if warmup is None else warmup):
        case.fn(*case.args())
    times = []
    if device.type == "cuda":
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
        for _ in range(rounds):
            args = case.args()
            flush.zero_()  # evict the inputs from L2: every round reads them from HBM
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            case.fn(*args)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return times
    for _ in range(rounds):
        args = case.args()
        start = time.perf_counter()
        case.fn(*args)
        times.append(time.perf_counter() - start)
    return times


def peak_extra_bytes(case: Case, device: torch.device) -> int:
    """Peak of (bytes allocated - bytes freed) by torch while ``case.fn`` runs, its outputs
    included. CUDA: the caching allocator's peak above the level before the call. CPU: the
    profiler's allocation records in time order; the fused kernels' output cache is emptied
    first, so a buffer they keep for reuse counts once, and buffers cached for other shapes or
    held by earlier results do not count."""
    device = torch.device(device)
    args = case.args()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = case.fn(*args)
        torch.cuda.synchronize(device)
        del out
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    from grpo_kernels.cpu_fused import OUTPUTS

    OUTPUTS.clear()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        case.fn(*args)
    deltas = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
                    if e.self_cpu_memory_usage)
    current = peak = 0
    for _, delta in deltas:
        current += delta
        peak = max(peak, current)
    return peak


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def make_row(case: Case, seconds: Sequence[float], peak: int, device: torch.device) -> dict:
    """The numbers of one measured case (times in ms, GB/s from the median)."""
    median = statistics.median(seconds)
    return dict(
        op=case.op, mode=case.mode, backend=case.backend, shape=list(case.shape),
        dtype=dtype_name(case.dtype), device=torch.device(device).type,
        threads=torch.get_num_threads(), median_ms=median * 1e3, min_ms=min(seconds) * 1e3,
        gbps=case.counted_bytes / median / 1e9, counted_bytes=case.counted_bytes,
        peak_extra_bytes=peak, peak_vs_input=peak / case.input_bytes,
    )


def measure(case: Case, device: torch.device, rounds: int | None = None,
            warmup: int | None = None) -> dict:
    """Time ``case`` and take its peak memory: one row."""
    seconds = time_call(case, device, rounds, warmup)
    return make_row(case, seconds, peak_extra_bytes(case, device), device)


def _key(row: dict) -> tuple:
    return row["op"], row["mode"], tuple(row["shape"]), row["dtype"]


def copy_bandwidth(rows: Sequence[dict]) -> dict[tuple, float]:
    """{(shape, dtype): GB/s} of the preallocated copies among ``rows``."""
    return {(tuple(r["shape"]), r["dtype"]): r["gbps"] for r in rows
            if r["op"] == "copy" and r["mode"] == "copy_"}


def annotate(rows: list[dict]) -> list[dict]:
    """Add to every row its GB/s as a fraction of the copy of the same bytes (``of_copy``) and
    its speed-up over eager torch on the same op, mode, shape and dtype (``vs_reference``)."""
    copies = copy_bandwidth(rows)
    reference = {_key(r): r["median_ms"] for r in rows if r["backend"] == "reference"}
    for r in rows:
        copy = copies.get((tuple(r["shape"]), r["dtype"]))
        ref = reference.get(_key(r))
        r["of_copy"] = r["gbps"] / copy if copy else None
        r["vs_reference"] = ref / r["median_ms"] if ref else None
    return rows


def run_suite(device: torch.device | str, *, rounds: int | None = None,
              warmup: int | None = None, **sizes) -> list[dict]:
    """Measure every case of `suite` on ``device``: the annotated rows."""
    device = torch.device(device)
    return annotate([measure(case, device, rounds, warmup) for case in suite(device, **sizes)])


def format_rows(rows: Sequence[dict]) -> list[str]:
    """The summary table: median ms, GB/s, % of the copy's GB/s, peak / input, speed-up."""
    lines = [f"{'op':<18}{'mode':<9}{'backend':<11}{'shape':<16}{'dtype':<9}{'median ms':>10}"
             f"{'GB/s':>8}{'% copy':>8}{'peak/in':>8}{'vs ref':>8}"]
    for r in rows:
        of_copy, vs_ref = r.get("of_copy"), r.get("vs_reference")
        lines.append(
            f"{r['op']:<18}{r['mode']:<9}{r['backend']:<11}{'x'.join(map(str, r['shape'])):<16}"
            f"{r['dtype']:<9}{r['median_ms']:>10.3f}{r['gbps']:>8.2f}"
            + (f"{100 * of_copy:>7.0f}%" if of_copy else f"{'-':>8}")
            + f"{r['peak_vs_input']:>8.2f}"
            + (f"{vs_ref:>7.1f}x" if vs_ref else f"{'-':>8}"))
    for (shape, dtype), gbps in sorted(copy_bandwidth(rows).items()):
        lines.append(f"copy_ bandwidth {'x'.join(map(str, shape))} {dtype}: {gbps:.2f} GB/s")
    return lines
