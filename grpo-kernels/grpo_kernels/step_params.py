"""One SDE step's parameters (sigma, sigma', eta, sigma_max), normalised for every backend.

Each parameter is a Python float (one value for the whole batch) or a tensor of shape [B] or []
on the latents' device, kept as given: nothing here reads a tensor's values, so building the
parameters never waits for the device and traces under torch.compile. The backends read them
where the math runs (the C and Triton kernels per row; the reference as [B] tensor ops).
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import NamedTuple

import torch

StepValue = float | torch.Tensor


class StepParams(NamedTuple):
    """sigma, sigma_next, eta, sigma_max (NaN when not given): floats or [B] / [] tensors."""

    sigma: StepValue
    sigma_next: StepValue
    eta: StepValue
    sigma_max: StepValue


def real_number(value: object) -> bool:
    """A Python or numpy real scalar (np.float32, np.int64, ...), but not a bool (numpy's
    np.bool_ is no numbers.Real, so it is refused too)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def numpy_array(value: object) -> bool:
    """A numpy array. numpy is optional here: if it was never imported, no array exists."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.ndarray)


def step_value(value: object, name: str, batch: int, device: torch.device) -> StepValue:
    """A number, a numpy array or a tensor -> a float or a [B] / [] tensor on `device`.

    Checks types, dtypes, shapes and devices only (no values): a value check needs the
    numbers on the host, which validation.check_step_values does when asked.
    """
    if type(value) is float:  # the common cases first: isinstance on an ABC costs ~1 us
        return value
    if isinstance(value, torch.Tensor):
        return _step_tensor(value, name, batch, device)
    if real_number(value):
        return float(value)
    if numpy_array(value):  # host data: copied to the device, never read back
        if value.dtype.kind != "f":
            raise ValueError(f"{name} must have a floating dtype, got numpy {value.dtype}")
        value = torch.as_tensor(value, device=device)
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"{name} must be a real number or a float tensor, got {type(value).__name__}"
        )
    return _step_tensor(value, name, batch, device)


def _step_tensor(value: torch.Tensor, name: str, batch: int, device: torch.device):
    if value.requires_grad:
        value = value.detach()  # constants: no gradient to the step parameters
    if not value.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {value.dtype}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but the latents are on {device}")
    if value.dim() == 0:
        return value
    if value.shape == (1,):
        return value.reshape(())
    if value.shape != (batch,):
        raise ValueError(
            f"{name} must be a scalar or a tensor of shape [{batch}] (one per sample), "
            f"got shape {tuple(value.shape)}"
        )
    return value


def step_params(x: torch.Tensor, sigma, sigma_next, eta, sigma_max) -> StepParams:
    """The checked, normalised parameters of a step on latents x [B, ...]."""
    batch, device = x.shape[0], x.device
    values = [step_value(value, name, batch, device)
              for value, name in ((sigma, "sigma"), (sigma_next, "sigma_next"), (eta, "eta"))]
    values.append(math.nan if sigma_max is None
                  else step_value(sigma_max, "sigma_max", batch, device))
    return StepParams(*values)


def step_rows(value: StepValue, batch: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """One parameter as a [B] tensor of `dtype` (torch.full for floats: no host-to-device copy,
    so no sync on CUDA)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype).expand(batch)
    return torch.full((batch,), value, dtype=dtype, device=device)


def all_rows(step: StepParams, batch: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, ...]:
    """Every parameter as [B] tensors: (sigma, sigma_next, eta, sigma_max)."""
    return tuple(step_rows(value, batch, dtype, device) for value in step)
