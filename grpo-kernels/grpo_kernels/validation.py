"""Input checks shared by every backend: bad input raises a ValueError naming the argument.

Two kinds of check. Argument checks (types, shapes, dtypes, devices, Python numbers) never read
a tensor's values and always run. Value checks read tensor values on the host (on CUDA: one
device-to-host copy, a sync); they run by default and `validate=False` skips them, the fast path
for a trusted caller and for torch.compile. Every `.tolist()` in grpo_kernels lives here.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence

import torch

from grpo_kernels.step_params import StepParams, real_number

SDE_KINDS = ("flow", "dance", "cps", "cps_mse")
REDUCTIONS = ("mean", "sum")
BACKENDS = ("reference", "triton", "cpu_fused")


def check_latents(check_nan: bool = False, **tensors: torch.Tensor) -> None:
    """Same shape [B, ...] (at least 2-D), floating dtype and device for every named tensor."""
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must have a floating dtype, got {t.dtype}; cast it first")
        if t.dim() < 2 or t.numel() == 0:
            raise ValueError(
                f"{name} must be a non-empty [B, ...] tensor with at least 2 dims, "
                f"got shape {tuple(t.shape)}"
            )
        if t.shape != first.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {first_name} has {tuple(first.shape)}; "
                "they must match"
            )
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "move them to one device"
            )
        if check_nan and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains NaN or Inf")


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32 whatever the input dtype, except that float64 inputs stay float64 (gradcheck)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def step_params_ok(sigma, sigma_next, eta, sigma_max, kind: str) -> bool:
    """Every per-sample step parameter is valid ([B] sequences of floats; sigma_max NaN = not
    given). Plain Python: a comparison with NaN is False, so NaN fails every range."""
    for s, s_next, e, s_max in zip(sigma, sigma_next, eta, sigma_max, strict=True):
        ok = 0 < s <= 1 and 0 <= s_next < s and e > 0 and math.isfinite(e)
        if kind == "flow":  # at sigma == 1, sigma_max must be given and in (0, 1)
            ok = ok and (s < 1 or 0 < s_max < 1)
        if kind == "cps":  # sigma_next == 0 leaves no noise, hence no density
            ok = ok and s_next > 0
        if not ok:
            return False
    return True


def _host_values(value) -> tuple[float, ...]:
    """A step parameter's values as Python floats: the one device-to-host copy (sync)."""
    if isinstance(value, torch.Tensor):
        values = value.tolist()  # [] or [B]
        return tuple(values) if isinstance(values, list) else (values,)
    return (value,)


def check_step_values(step: StepParams, kind: str, batch: int) -> None:
    """Value checks on a step's parameters (reads them on the host; see the module doc)."""
    _check_step_values(kind, batch, *map(_host_values, step))


@functools.lru_cache(maxsize=256)
def _check_step_values(kind: str, batch: int, *values: tuple[float, ...]) -> None:
    """Cached per distinct values: a rollout repeats a handful of steps, and a hit costs well
    under a microsecond. lru_cache never stores an exception, so bad values raise every time."""
    rows = [[float(x) for x in v] * (batch if len(v) == 1 else 1) for v in values]
    check_sde_args(kind, *rows)


def check_noise_finite(noise: torch.Tensor, logp: torch.Tensor) -> None:
    """A non-finite noise makes that sample's log-prob non-finite: check the [B] log-prob
    on the host (a microsecond on the CPU; one small copy on CUDA), and the noise itself only
    then (x or v with NaN propagate as without sampling)."""
    if all(map(math.isfinite, logp.tolist())):
        return
    if not bool(torch.isfinite(noise).all()):
        raise ValueError(
            "noise contains NaN or Inf; draw it with torch.randn (or pass validate=False to "
            "skip this check)"
        )


def check_real(
    value: object, name: str, *, low: float | None = None, high: float | None = None,
    low_open: bool = False, high_open: bool = False, hint: str = "",
) -> float:
    """A finite real number (Python or numpy scalar) in the given range -> float."""
    if not real_number(value):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__}{hint}")
    number = float(value)
    too_low = low is not None and (number <= low if low_open else number < low)
    too_high = high is not None and (number >= high if high_open else number > high)
    if not math.isfinite(number) or too_low or too_high:
        left = "any" if low is None else ("(" if low_open else "[") + f"{low}"
        right = "any" if high is None else f"{high}" + (")" if high_open else "]")
        raise ValueError(f"{name} must be a finite number in {left}, {right}, got {value}{hint}")
    return number


def check_step_scalars(eta: object, sigma_max: object) -> None:
    """The fixed settings of a step (a module's constructor): a number must be in range."""
    if real_number(eta):
        check_real(eta, "eta", low=0.0, low_open=True,
                   hint="; eta must be > 0 for a stochastic step (use ode_step for eta = 0)")
    if sigma_max is not None and real_number(sigma_max):
        check_real(sigma_max, "sigma_max", low=0.0, high=1.0, low_open=True, high_open=True)


def check_sde_kind(kind: str, reduction: str = "mean") -> None:
    if kind not in SDE_KINDS:
        hint = "; use ode_step for a deterministic step" if kind == "ode" else ""
        raise ValueError(f"kind must be one of {SDE_KINDS}, got {kind!r}{hint}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_sde_args(kind: str, sigma, sigma_next, eta, sigma_max) -> None:
    """Value checks on the per-sample step parameters ([B] lists of floats)."""
    if step_params_ok(sigma, sigma_next, eta, sigma_max, kind):
        return  # the common path; the detailed messages follow on failure
    rows = list(zip(sigma, sigma_next, eta, sigma_max, strict=True))
    if not all(0 < s <= 1 for s, _, _, _ in rows):
        raise ValueError(f"sigma must lie in (0, 1], got {list(sigma)}")
    if not all(0 <= n < s for s, n, _, _ in rows):
        raise ValueError(
            f"sigma_next must satisfy 0 <= sigma_next < sigma (the step goes towards the data), "
            f"got sigma={list(sigma)}, sigma_next={list(sigma_next)}"
        )
    if not all(e > 0 and math.isfinite(e) for _, _, e, _ in rows):
        raise ValueError(
            f"eta must be a finite number > 0 for a stochastic step, got {list(eta)}; "
            "use ode_step for eta = 0"
        )
    if kind == "flow":
        if any(s == 1 and math.isnan(m) for s, _, _, m in rows):
            raise ValueError(
                "sigma_max is required for kind='flow' when sigma == 1: pass the schedule's s_1 "
                "(sigmas[1]), which replaces sigma in the std's denominator"
            )
        raise ValueError(f"sigma_max must lie in (0, 1), got {list(sigma_max)}")
    raise ValueError(
        "sigma_next == 0 gives kind='cps' zero noise, so the step has no density: the last "
        "transition is deterministic; use ode_step (or kind='cps_mse') for it"
    )


def check_chunk_loss_args(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    chunk_sizes: Sequence[int],
    chunk_mask: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    adv_clip_max: float | None,
    kl_coef: float,
) -> None:
    """Argument checks of chunk_grpo_loss (no tensor values read)."""
    for name, t in (("logp_new", logp_new), ("logp_old", logp_old), ("advantages", advantages)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must have a floating dtype, got {t.dtype}")
        if t.device != logp_new.device:
            raise ValueError(f"{name} is on {t.device} but logp_new is on {logp_new.device}")
    if logp_new.dim() != 2:
        raise ValueError(f"logp_new must be [B, S], got shape {tuple(logp_new.shape)}")
    if logp_old.shape != logp_new.shape:
        raise ValueError(
            f"logp_old has shape {tuple(logp_old.shape)} but logp_new has "
            f"{tuple(logp_new.shape)}; they must match"
        )
    batch, steps = logp_new.shape
    if advantages.shape != (batch,):
        raise ValueError(
            f"advantages must have shape [{batch}] (one per sample), got {tuple(advantages.shape)}"
        )
    if batch == 0:
        raise ValueError("logp_new has no samples (B = 0): pass at least one sample")
    check_chunk_settings(chunk_sizes, clip_low, clip_high, adv_clip_max, kl_coef)
    sizes = [int(c) for c in chunk_sizes]
    if sum(sizes) != steps:
        raise ValueError(
            f"chunk_sizes {sizes} sum to {sum(sizes)} but logp_new has S={steps} steps; "
            "they must sum to S"
        )
    if chunk_mask is not None:
        if not isinstance(chunk_mask, torch.Tensor) or chunk_mask.dtype != torch.bool:
            raise ValueError("chunk_mask must be a bool tensor of shape [B, K]")
        if chunk_mask.shape != (batch, len(sizes)):
            raise ValueError(
                f"chunk_mask must have shape [B, K] = [{batch}, {len(sizes)}], "
                f"got {tuple(chunk_mask.shape)}"
            )
        if chunk_mask.device != logp_new.device:
            raise ValueError(f"chunk_mask is on {chunk_mask.device}, logp_new on {logp_new.device}")


def check_chunk_mask_values(chunk_mask: torch.Tensor | None) -> None:
    """A value check (reads the mask): at least one (sample, chunk) pair trains."""
    if chunk_mask is not None and not bool(chunk_mask.any()):
        raise ValueError("chunk_mask selects no chunk: at least one (sample, chunk) must train")


def check_chunk_settings(
    chunk_sizes: Sequence[int], clip_low: object, clip_high: object, adv_clip_max: object,
    kl_coef: object,
) -> None:
    """The loss's fixed settings (also a module's constructor): sizes and finite numbers."""
    try:
        sizes = list(chunk_sizes)
    except TypeError:
        sizes = []
    # numpy's integers are numbers.Integral; bool is too, and np.bool_ is not.
    if len(sizes) == 0 or not all(isinstance(c, numbers.Integral) and not isinstance(c, bool)
                                  for c in sizes):
        raise ValueError(f"chunk_sizes must be a non-empty sequence of ints, got {chunk_sizes!r}")
    if any(c <= 0 for c in sizes):
        raise ValueError(f"chunk_sizes must all be >= 1, got {[int(c) for c in sizes]}")
    check_real(clip_low, "clip_low", low=0.0, high=1.0, high_open=True)
    check_real(clip_high, "clip_high", low=0.0)
    if adv_clip_max is not None:
        check_real(adv_clip_max, "adv_clip_max", low=0.0, low_open=True,
                   hint="; use None for no clipping")
    check_real(kl_coef, "kl_coef", low=0.0, hint="; use 0 for no KL term")


def check_backend(backend: str | None) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
