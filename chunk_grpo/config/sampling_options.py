"""The sampler's named choices and their checks, in one place and free of torch.

The config, the command-line parsers and the samplers all validate against these, so a kind or
a decode target is spelled once. (`grpo_kernels` keeps its own list of the kinds it implements,
as a standalone library must; a test checks the two agree.)
"""

from __future__ import annotations

from typing import Literal, get_args

SDEKind = Literal["flow", "dance", "cps", "cps_mse"]  # the stochastic samplers (grpo_kernels')
DecodeTarget = Literal["final", "x0"]  # decode the final latent, or the last step's x0 prediction
# what plain generation may use: the ODE or a stochastic kind (a test keeps it = ode + SDEKind)
Sampler = Literal["ode", "flow", "dance", "cps", "cps_mse"]
SDE_KINDS: tuple[str, ...] = get_args(SDEKind)
SAMPLERS: tuple[str, ...] = get_args(Sampler)
DECODE_TARGETS: tuple[str, ...] = get_args(DecodeTarget)


def check_sde_kind(kind: str, error: type[ValueError] = ValueError) -> None:
    """A training rollout needs a stochastic kind (one with log-probabilities)."""
    if kind not in SDE_KINDS:
        raise error(f"kind must be one of {SDE_KINDS} for training rollouts, got {kind!r}")


def check_decode(decode: str, error: type[ValueError] = ValueError) -> None:
    if decode not in DECODE_TARGETS:
        raise error(f"decode must be 'final' or 'x0', got {decode!r}")


def check_antithetic(antithetic: bool, group_size: int,
                     error: type[ValueError] = ValueError) -> None:
    """Antithetic noise pairs rows 2i and 2i+1 of a group, so a group must hold whole pairs."""
    if antithetic and group_size % 2:
        raise error(f"sampling.antithetic_noise pairs the images of a group: sampling.group_size "
                    f"must be even, got {group_size}; give an even group size or turn "
                    "antithetic noise off")


def resolve_cfg_scale(policy, cfg_scale: float | None) -> float:
    """``cfg_scale``, or the model's default (its sampling side file) when None."""
    return policy.default_cfg_scale if cfg_scale is None else cfg_scale
