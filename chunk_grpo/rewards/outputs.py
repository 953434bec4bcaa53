"""What a reward may return, and the errors when it fails.

A reward returns one number per image. A float tensor of shape [B] is used as it is; a Python
list or tuple, a numpy array or an integer/bool tensor of B numbers is converted to float32. The
wrong length or shape, a non-numeric value, or an exception raised inside the reward is a
`RewardOutputError` naming the reward and what it returned. NaN/Inf values pass: the trainer logs
and skips such a step.
"""

from __future__ import annotations

import numpy as np
import torch


class RewardError(ValueError):
    """A reward failed or returned something unusable; the message names the reward and the fix
    (one line: the command-line entry points print it and exit with status 2)."""


class RewardOutputError(RewardError):
    """A reward raised, or returned something that is not one number per image."""


class RewardUnavailableError(RewardError):
    """A remote reward's server could not be reached (or kept failing) within the retries."""


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def describe(value: object) -> str:
    """A short description of what a reward returned, for error messages."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, np.ndarray):
        return f"a numpy array of shape {value.shape} and dtype {value.dtype}"
    if isinstance(value, (list, tuple)):
        head = ", ".join(repr(v) for v in value[:3]) + (", ..." if len(value) > 3 else "")
        return f"a {type(value).__name__} of {len(value)} items [{head}]"
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def check_reward_output(label: str, output: object, n: int) -> torch.Tensor:
    """``output`` of the reward ``label`` for ``n`` images as float32 CPU [n], or a
    RewardOutputError naming the reward and what it returned."""
    value = output
    if isinstance(value, (list, tuple)):
        try:
            value = np.asarray(value)
        except (TypeError, ValueError):
            value = np.asarray(value, dtype=object)
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value) if value.dtype.kind in "biuf" else None
    ok = (isinstance(value, torch.Tensor)
          and (value.is_floating_point() or value.dtype in (torch.bool, torch.uint8, torch.int8,
                                                            torch.int16, torch.int32, torch.int64))
          and tuple(value.shape) == (n,))
    if not ok:
        raise RewardOutputError(
            f"reward {label!r} returned {describe(output)} for {n} images; a reward must return "
            f"one number per image: a float tensor of shape [{n}] (a list or numpy array of {n} "
            f"numbers is converted)")
    return value.detach().to("cpu", torch.float32).contiguous()


def call_reward(label: str, reward, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """``reward(images, prompts)`` checked by `check_reward_output`; an exception raised inside
    the reward becomes a RewardOutputError naming it (the original is chained)."""
    try:
        output = reward(images, prompts)
    except RewardError:
        raise
    except (Exception, SystemExit) as err:  # a reward calling sys.exit() must not end a run
        raise RewardOutputError(
            f"reward {label!r} raised {type(err).__name__} while scoring {len(prompts)} images: "
            f"{_first_line(str(err))}; fix the reward (the traceback is chained to this error)"
        ) from err
    return check_reward_output(label, output, len(prompts))
