"""Input checks shared by every backend: bad input raises a ValueError naming the argument."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

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


def step_values(
    value: float | torch.Tensor | np.ndarray, name: str, batch: int, device: torch.device
) -> tuple[float, ...]:
    """A Python number, a 0-d / [1] tensor or a [B] tensor -> its checked values as Python
    floats: one for a scalar, B for per-sample values.

    Floats convert exactly from any float dtype, and a tuple of them hashes in well under a
    microsecond, so these tuples key the coefficient cache (sde_coefficients.py).
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number or tensor, got a bool")
    if isinstance(value, (int, float)):
        return (float(value),)
    if isinstance(value, np.ndarray) and value.shape == (batch,):
        return tuple(value.astype(np.float64, copy=False).tolist())
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a float or a tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {value.dtype}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but the latents are on {device}")
    if value.dim() == 0 or value.shape == (1,):
        return (float(value.reshape(())),)
    if value.shape != (batch,):
        raise ValueError(
            f"{name} must be a scalar or a tensor of shape [{batch}] (one per sample), "
            f"got shape {tuple(value.shape)}"
        )
    return tuple(value.tolist())


def broadcast(values: tuple[float, ...] | None, batch: int) -> np.ndarray:
    """step_values' tuple -> a float64 numpy array [B]; None (not given) -> NaN."""
    if values is None:
        return np.full(batch, np.nan)
    if len(values) == 1:
        return np.full(batch, values[0])
    return np.array(values, dtype=np.float64)


def per_sample(
    value: float | torch.Tensor, name: str, batch: int, device: torch.device
) -> np.ndarray:
    """A Python number, a 0-d tensor or a [B] tensor -> a checked float64 numpy array [B]."""
    return broadcast(step_values(value, name, batch, device), batch)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32 whatever the input dtype, except that float64 inputs stay float64 (gradcheck)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def step_params_ok(sigma, sigma_next, eta, sigma_max, kind: str) -> bool:
    """Every per-sample step parameter is valid (numpy [B] arrays; sigma_max NaN = not given)."""
    ok = (sigma > 0) & (sigma <= 1) & (sigma_next >= 0) & (sigma_next < sigma)
    ok &= (eta > 0) & np.isfinite(eta)
    if kind == "flow":  # at sigma == 1, sigma_max must be given and in (0, 1)
        ok &= (sigma < 1) | ((sigma_max > 0) & (sigma_max < 1))
    if kind == "cps":  # sigma_next == 0 leaves no noise, hence no density
        ok &= sigma_next > 0
    return bool(ok.all())


def check_sde_kind(kind: str, reduction: str = "mean") -> None:
    if kind not in SDE_KINDS:
        hint = "; use ode_step for a deterministic step" if kind == "ode" else ""
        raise ValueError(f"kind must be one of {SDE_KINDS}, got {kind!r}{hint}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_sde_args(kind: str, sigma, sigma_next, eta, sigma_max) -> None:
    """Value checks on the per-sample step parameters (float64 numpy arrays [B])."""
    if step_params_ok(sigma, sigma_next, eta, sigma_max, kind):
        return  # the common path; the detailed messages follow on failure
    if not ((sigma > 0) & (sigma <= 1)).all():
        raise ValueError(f"sigma must lie in (0, 1], got {sigma.tolist()}")
    if not ((sigma_next >= 0) & (sigma_next < sigma)).all():
        raise ValueError(
            f"sigma_next must satisfy 0 <= sigma_next < sigma (the step goes towards the data), "
            f"got sigma={sigma.tolist()}, sigma_next={sigma_next.tolist()}"
        )
    if not ((eta > 0) & np.isfinite(eta)).all():
        raise ValueError(
            f"eta must be a finite number > 0 for a stochastic step, got {eta.tolist()}; "
            "use ode_step for eta = 0"
        )
    if kind == "flow":
        if np.isnan(sigma_max[sigma == 1]).any():
            raise ValueError(
                "sigma_max is required for kind='flow' when sigma == 1: pass the schedule's s_1 "
                "(sigmas[1]), which replaces sigma in the std's denominator"
            )
        raise ValueError(f"sigma_max must lie in (0, 1), got {sigma_max.tolist()}")
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
) -> None:
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
    sizes = list(chunk_sizes)
    if len(sizes) == 0 or any(isinstance(c, bool) or not isinstance(c, int) for c in sizes):
        raise ValueError(f"chunk_sizes must be a non-empty sequence of ints, got {chunk_sizes!r}")
    if any(c <= 0 for c in sizes):
        raise ValueError(f"chunk_sizes must all be >= 1, got {sizes}")
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
        if not bool(chunk_mask.any()):
            raise ValueError("chunk_mask selects no chunk: at least one (sample, chunk) must train")
    if not (0 <= clip_low < 1):
        raise ValueError(f"clip_low must lie in [0, 1), got {clip_low}")
    if not clip_high >= 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if adv_clip_max is not None and not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be > 0 or None, got {adv_clip_max}")


def check_backend(backend: str | None) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
