"""Fused CPU kernels: hand-written C (csrc/sde_step.c), built once with the system compiler.

Each pass reads the [B, N] latents once and writes only what it returns: the SDE mean is never
stored, nor is any other [B, N] temporary. The library is compiled on first use (well under a
second with gcc, cached per source and CPU under ~/.cache/grpo_kernels, or
$GRPO_KERNELS_CACHE) and called through ctypes. It takes fp32 or bf16 latents; other dtypes
are converted to fp32 first, and float64 (gradcheck) runs the same formulas in eager torch.
Without a working C compiler every call runs the eager torch version (a warning says so).

Interface as triton_kernels: contiguous [B, N] latents; the [B] coefficients come as float64
numpy arrays (computed on the host, see sde_coefficients.py).
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

import numpy as np
import torch

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
                subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True,
                               capture_output=True, text=True)
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


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def _coef_ptrs(*coefs: np.ndarray) -> tuple[np.ndarray, list[ctypes.c_void_p]]:
    """One fp32 block holding every [B] coefficient, and a pointer to each row of it.
    The caller keeps the block alive until the C call returns."""
    block = np.ascontiguousarray(np.stack(coefs), dtype=np.float32)
    base, row = block.ctypes.data, block.shape[1] * 4
    return block, [ctypes.c_void_p(base + i * row) for i in range(len(coefs))]


def _torch(c: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Coefficients for the eager path, in its compute dtype (fp64 for fp64 inputs)."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return torch.from_numpy(np.asarray(c)).to(dtype)


def _native(*tensors: torch.Tensor) -> tuple[str | None, tuple[torch.Tensor, ...]]:
    """(C suffix, tensors in its dtype) or (None, ...) when the eager path must run."""
    if any(t.device.type != "cpu" for t in tensors) or library() is None:
        return None, tensors
    dtype = tensors[0].dtype
    if dtype == torch.float64:
        return None, tensors
    if dtype not in _SUFFIX or any(t.dtype != dtype for t in tensors):
        tensors = tuple(t.float() for t in tensors)  # fp16 or mixed dtypes: one conversion
        dtype = torch.float32
    return _SUFFIX[dtype], tuple(t.contiguous() for t in tensors)


def _residual(x, v, x_next, a, b):
    """x' - m, m = a x + b v, in the compute dtype (the eager fallback)."""
    a, b = _torch(a, x), _torch(b, x)
    dtype = a.dtype
    return x_next.to(dtype) - a[:, None] * x.to(dtype) - b[:, None] * v.to(dtype)


def sde_logprob_fwd(x, v, x_next, a, b, alpha, beta):
    """logp [B] = alpha * sum_k (x' - a x - b v)^2 + beta, one pass over the latents."""
    suffix, (x, v, x_next) = _native(x, v, x_next)
    if suffix is None:
        d = _residual(x, v, x_next, a, b)
        return _torch(alpha, x) * (d * d).sum(dim=1) + _torch(beta, x)
    rows, n = x.shape
    logp = torch.empty(rows, dtype=torch.float32)
    _block, coef = _coef_ptrs(a, b, alpha, beta)
    getattr(library(), f"sde_logprob_fwd_{suffix}")(
        _ptr(x), _ptr(v), _ptr(x_next), *coef, _ptr(logp),
        ctypes.c_int64(rows), ctypes.c_int64(n),
    )
    return logp


def sde_logprob_bwd(x, v, x_next, a, b, scale, want_x, want_v, want_next):
    """Gradients of sum_i g[i] logp[i], scale = 2 alpha g: d/dx' = scale (x' - m),
    d/dx = -a scale (x' - m), d/dv = -b scale (x' - m); one pass writes all requested."""
    like = (x, v, x_next)
    suffix, (x, v, x_next) = _native(x, v, x_next)
    if suffix is None:
        d = _residual(x, v, x_next, a, b)
        grads = [(_torch(s, x)[:, None] * d) if want else None
                 for s, want in ((-a * scale, want_x), (-b * scale, want_v), (scale, want_next))]
    else:
        rows, n = x.shape
        grads = [OUTPUTS.empty(x.shape, x.dtype) if want else None
                 for want in (want_x, want_v, want_next)]
        _block, coef = _coef_ptrs(a, b, -a * scale, -b * scale, scale)
        getattr(library(), f"sde_logprob_bwd_{suffix}")(
            _ptr(x), _ptr(v), _ptr(x_next), *coef, *map(_ptr, grads),
            ctypes.c_int64(rows), ctypes.c_int64(n),
        )
    return tuple(None if g is None else g.to(t.dtype) for g, t in zip(grads, like, strict=True))


def sde_sample(x, v, noise, a, b, n):
    """x' = a x + b v + n eps, stored in x's dtype."""
    out_dtype = x.dtype
    suffix, (x, v, noise) = _native(x, v, noise)
    if suffix is None:
        a, b, n = (_torch(c, x) for c in (a, b, n))
        dtype = a.dtype
        out = a[:, None] * x.to(dtype) + b[:, None] * v.to(dtype) + n[:, None] * noise.to(dtype)
        return out.to(out_dtype)
    rows, numel = x.shape
    out = OUTPUTS.empty(x.shape, x.dtype)
    _block, coef = _coef_ptrs(a, b, n)
    getattr(library(), f"sde_sample_{suffix}")(
        _ptr(x), _ptr(v), _ptr(noise), *coef, _ptr(out),
        ctypes.c_int64(rows), ctypes.c_int64(numel),
    )
    return out.to(out_dtype)
