"""Fused CPU kernels: hand-written C (csrc/sde_step.c), built once with the system compiler.

Each pass reads the [B, N] latents once and writes only what it returns: the SDE mean is never
stored, nor is any other [B, N] temporary. The library is compiled on first use (well under a
second with gcc, cached per source and CPU under ~/.cache/grpo_kernels, or
$GRPO_KERNELS_CACHE) and called through ctypes. It takes fp32 or bf16 latents; other dtypes
are converted to fp32 first, and float64 (gradcheck) runs the same formulas in eager torch.
Without a working C compiler every call runs the eager torch version (a warning says so).

Latents come as [B, ...] tensors, the step as StepParams: the C code reads each parameter
where it lies (a CPU tensor's memory, or a float passed by address) and computes the per-row
coefficients itself, so a call costs one ctypes call and no torch op beyond its outputs. The
eager fallback computes the same coefficients with torch ops (sde_coefficients.py). The eager
chunk terms of the loss (this backend has no C kernel for them) live here too.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections import OrderedDict
from pathlib import Path

import torch

from grpo_kernels.sde_coefficients import step_coefficients
from grpo_kernels.step_params import StepParams

SOURCE = Path(__file__).with_name("csrc") / "sde_step.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _cpu_signature() -> str:
    """-march=native code is CPU-specific: key the cache on the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (with one warning) when it cannot be built."""
    compiler = os.environ.get("CC", "cc")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("GRPO_KERNELS_CACHE", Path.home() / ".cache" / "grpo_kernels"))
    target = cache / f"sde_step-{key}.so"
    try:
        if not target.exists():
            if shutil.which(compiler) is None:
                raise RuntimeError(f"C compiler {compiler!r} not found (set CC)")
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                built = Path(tmp) / target.name
                subprocess.run([compiler, *FLAGS, str(SOURCE), "-lm", "-o", str(built)],
                               check=True, capture_output=True, text=True)
                os.replace(built, target)  # atomic: concurrent processes never see half a file
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or err
        warnings.warn(f"grpo_kernels: cannot build the fused CPU kernels ({detail}); "
                      "falling back to eager torch (correct, slower)", stacklevel=3)
        return None


class OutputCache:
    """Reuses the large output tensors of the kernels once every caller has dropped them.

    A fresh multi-MB tensor comes from mmap, and writing it page-faults every 4 KB page:
    that costs more than the kernel itself (about 1 ms for a 3.6 MB gradient here). A cached
    tensor is reused only when no tensor, view or autograd node references its storage any
    more, so results never alias. At most ``max_bytes`` are held (least recently used first
    out); ``clear()`` frees them.
    """

    MIN_BYTES = 1 << 20  # smaller tensors come from the heap, already faulted in
    # A private torch call (pinned torch); without it the cache stays off.
    SUPPORTED = hasattr(torch._C, "_storage_Use_Count")

    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes = max_bytes
        self._tensors: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _free(t: torch.Tensor) -> bool:
        # References: the cache's tensor and the temporary storage object made here.
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if not self.SUPPORTED or math.prod(shape) * dtype.itemsize < self.MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            for key, t in self._tensors.items():
                if t.shape == shape and t.dtype == dtype and self._free(t):
                    self._tensors.move_to_end(key)
                    return t.view(shape)
            t = torch.empty(shape, dtype=dtype)
            self._tensors[id(t)] = t
            while sum(c.nbytes for c in self._tensors.values()) > self.max_bytes:
                self._tensors.popitem(last=False)
            # Always hand out a view: it is a second reference to the storage, which is what
            # `_free` counts (the cache's own tensor object would not show up there).
            return t.view(shape)

    def held_bytes(self) -> int:
        """Bytes of cached tensors nobody else uses (memory held between calls)."""
        with self._lock:
            return sum(t.nbytes for t in self._tensors.values() if self._free(t))

    def clear(self) -> None:
        with self._lock:
            self._tensors.clear()


OUTPUTS = OutputCache()


_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
# The step's parameters (see STEP_ARGS in csrc/sde_step.c): 4 pointers, 4 strides, f64, kind, mean.
_STEP = [_PTR] * 4 + [_I64] * 7
_ARGTYPES = {  # declared once, so a call passes plain ints (no ctypes objects per argument)
    "sde_logprob_fwd": [_PTR] * 3 + _STEP + [_PTR] + [_I64] * 2,  # x, v, x', step, logp; rows, n
    # x, v, x', step, g, g's stride, gx, gv, gx'; rows, n
    "sde_logprob_bwd": [_PTR] * 3 + _STEP + [_PTR, _I64] + [_PTR] * 3 + [_I64] * 2,
    "sde_sample": [_PTR] * 3 + _STEP + [_PTR] + [_I64] * 2,  # x, v, eps, step, out; rows, n
}
_KINDS = {"flow": 0, "dance": 1, "cps": 2, "cps_mse": 3}
_FOUR_DOUBLES = ctypes.c_double * 4


@functools.cache
def _kernel(name: str):
    """The library's function `name` (e.g. "sde_sample_f32"), its signature declared."""
    fn = getattr(library(), name)
    fn.argtypes, fn.restype = _ARGTYPES[name.rsplit("_", 1)[0]], None
    return fn


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _step_args(step: StepParams, kind: str, reduction: str, keep: list) -> tuple[int, ...]:
    """The C arguments of a step: where each parameter lies, its stride and width. Floats go
    into one small double array; `keep` holds what the addresses point into until the call
    returns."""
    numbers = _FOUR_DOUBLES(*(v if type(v) is float else 0.0 for v in step))
    base = ctypes.addressof(numbers)
    keep.append(numbers)
    pointers, strides, f64 = [], [], 0
    for j, value in enumerate(step):
        if type(value) is float:
            pointers.append(base + 8 * j)
            strides.append(0)
            f64 |= 1 << j
            continue
        if value.dtype not in (torch.float32, torch.float64):
            value = value.double()  # fp16 / bf16 parameters: exact in double
        keep.append(value)
        pointers.append(value.data_ptr())
        strides.append(value.stride(0) if value.dim() else 0)
        f64 |= (value.dtype == torch.float64) << j
    return (*pointers, *strides, f64, _KINDS[kind], int(reduction == "mean"))


def _native(*tensors: torch.Tensor):
    """(C suffix, contiguous tensors in its dtype) or (None, ...) when the eager path runs."""
    dtype = tensors[0].dtype
    # Step tensors lie on the latents' device (step_params checks it): the latents decide.
    if not all(t.is_cpu for t in tensors) or library() is None or dtype == torch.float64:
        return None, tensors
    if dtype not in _SUFFIX or any(t.dtype != dtype for t in tensors):
        tensors = tuple(t.float() for t in tensors)  # fp16 or mixed dtypes: one conversion
        dtype = torch.float32
    return _SUFFIX[dtype], tuple(t.contiguous() for t in tensors)


def _compute_dtype(like: torch.Tensor) -> torch.dtype:
    return torch.float64 if like.dtype == torch.float64 else torch.float32


def _coefficients(step, kind, reduction, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(a, b, n, alpha, beta) [B] float64 for the eager path: the C kernels' arithmetic."""
    batch = like.shape[0]
    return step_coefficients(step, kind, reduction, like.numel() // batch, batch, like.device)


def _residual(x, v, x_next, a, b):
    """x' - m, m = a x + b v, as [B, N] in a's dtype (the eager fallback)."""
    x, v, x_next = (t.reshape(t.shape[0], -1).to(a.dtype) for t in (x, v, x_next))
    return x_next - a[:, None] * x - b[:, None] * v


def sde_logprob_fwd(x, v, x_next, step: StepParams, kind: str, reduction: str) -> torch.Tensor:
    """logp [B] = alpha * sum_k (x' - a x - b v)^2 + beta over [B, ...] latents, one pass."""
    suffix, (x, v, x_next) = _native(x, v, x_next)
    if suffix is None:
        dtype = _compute_dtype(x)
        a, b, _, alpha, beta = (c.to(dtype) for c in _coefficients(step, kind, reduction, x))
        d = _residual(x, v, x_next, a, b)
        return alpha * (d * d).sum(dim=1) + beta
    rows, keep = x.shape[0], []
    logp = torch.empty(rows, dtype=torch.float32)
    _kernel(f"sde_logprob_fwd_{suffix}")(
        x.data_ptr(), v.data_ptr(), x_next.data_ptr(), *_step_args(step, kind, reduction, keep),
        logp.data_ptr(), rows, x.numel() // rows,
    )
    return logp


def sde_logprob_bwd(x, v, x_next, step: StepParams, kind: str, reduction: str, grad_logp,
                    want_x: bool, want_v: bool, want_next: bool):
    """Gradients of sum_i g[i] logp[i] for [B, ...] latents, scale = 2 alpha g: d/dx' =
    scale (x' - m), d/dx = -a scale (x' - m), d/dv = -b scale (x' - m); one pass writes all
    requested. The kernel forms the scales from g itself, in float64 as the eager path does."""
    like, wants = (x, v, x_next), (want_x, want_v, want_next)
    suffix, (x, v, x_next) = _native(x, v, x_next)
    if suffix is None:
        dtype = _compute_dtype(x)
        a, b, _, alpha, _ = _coefficients(step, kind, reduction, x)  # float64, as in C
        scale = 2 * alpha * grad_logp.detach().double()
        d = _residual(x, v, x_next, a.to(dtype), b.to(dtype))
        grads = [((s * scale).to(dtype)[:, None] * d).reshape(t.shape) if want else None
                 for s, want, t in zip((-a, -b, 1), wants, like, strict=True)]
    else:
        rows, keep = x.shape[0], []
        grad = grad_logp.to(torch.float32)  # often stride 0 (the backward of .sum()): kept
        grads = [OUTPUTS.empty(x.shape, x.dtype) if want else None for want in wants]
        _kernel(f"sde_logprob_bwd_{suffix}")(
            x.data_ptr(), v.data_ptr(), x_next.data_ptr(),
            *_step_args(step, kind, reduction, keep), grad.data_ptr(), grad.stride(0),
            *map(_ptr, grads), rows, x.numel() // rows,
        )
    return tuple(None if g is None else g.to(t.dtype) for g, t in zip(grads, like, strict=True))


def sde_sample(x, v, noise, step: StepParams, kind: str) -> torch.Tensor:
    """x' = a x + b v + n eps for [B, ...] latents, stored in x's dtype."""
    out_dtype = x.dtype
    suffix, (x, v, noise) = _native(x, v, noise)
    if suffix is None:
        dtype = _compute_dtype(x)
        a, b, n, _, _ = (c.to(dtype)[:, None] for c in _coefficients(step, kind, "mean", x))
        x2, v2, e2 = (t.reshape(t.shape[0], -1).to(a.dtype) for t in (x, v, noise))
        return (a * x2 + b * v2 + n * e2).reshape(x.shape).to(out_dtype)
    rows, keep = x.shape[0], []
    out = OUTPUTS.empty(x.shape, x.dtype)
    _kernel(f"sde_sample_{suffix}")(
        x.data_ptr(), v.data_ptr(), noise.data_ptr(), *_step_args(step, kind, "mean", keep),
        out.data_ptr(), rows, x.numel() // rows,
    )
    return out.to(out_dtype)


def chunk_terms(delta, advantages, chunk_id, sizes, clip_low, clip_high):
    """Per (sample, chunk): ratio, loss, d loss / d log-ratio, and mean k3, in one pass of
    eager torch ops ([B, K] each, delta's dtype). chunk_id [S]: each step's chunk; sizes [K]."""
    batch, num_chunks = delta.shape[0], sizes.shape[0]
    log_ratio = delta.new_zeros(batch, num_chunks).index_add_(1, chunk_id, delta) / sizes
    ratio = torch.exp(log_ratio)  # exactly 1.0 when logp_new == logp_old bit-for-bit
    unclipped = -advantages[:, None] * ratio
    clipped = -advantages[:, None] * ratio.clamp(1 - clip_low, 1 + clip_high)
    take_unclipped = unclipped >= clipped
    loss = torch.where(take_unclipped, unclipped, clipped)
    # d max(...) / d log r: the clipped branch is flat wherever it wins.
    grad_log_ratio = torch.where(take_unclipped, unclipped, torch.zeros_like(unclipped))
    k3 = torch.exp(-delta) + delta - 1
    kl = delta.new_zeros(batch, num_chunks).index_add_(1, chunk_id, k3) / sizes
    return ratio, loss, grad_log_ratio, kl
