"""Noise keyed by the image, not by the process: world-size-invariant sampling.

Every image's noise comes from its own generator, seeded from (seed, step, purpose, global
index). A rank that samples images [offset, offset + n) of a global batch therefore draws
exactly the noise one process sampling the whole batch draws for them, so N ranks with P
prompts each and 1 rank with N * P prompts sample the same images; a resumed run needs no saved
generator state. ``purpose`` separates the draws of one image ("initial" noise, "steps" noise,
a G2RPO "branch" step), so adding one kind of draw never shifts another.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch


def image_generator(seed: int, step: int, purpose: str, index: int) -> torch.Generator:
    """A CPU generator for one image's ``purpose`` draw; the same key, the same numbers."""
    if index < 0:
        raise ValueError(f"an image index must be >= 0, got {index}")
    # random.Random hashes a str seed with SHA-512: stable across processes and Python runs.
    key = random.Random(f"{seed}:{step}:{purpose}:{index}").getrandbits(63)
    return torch.Generator().manual_seed(key)


def initial_noise(policy, indices: Sequence[int], *, seed: int, step: int = 0,
                  purpose: str = "initial") -> torch.Tensor:
    """Packed initial latents [len(indices), N, C]: row i is the draw FluxPipeline makes for a
    batch of one with the generator of image ``indices[i]``."""
    return torch.cat([policy.initial_noise(1, image_generator(seed, step, purpose, i))
                      for i in indices])


def step_noise(indices: Sequence[int], latent_shape: tuple[int, ...], num_draws: int, *,
               seed: int, step: int = 0, purpose: str = "steps") -> torch.Tensor:
    """Standard normal draws [num_draws, len(indices), *latent_shape] (float32, CPU): each
    image's ``num_draws`` step draws from its own generator, step-major."""
    if not indices:
        return torch.zeros((num_draws, 0, *latent_shape))
    return torch.stack([torch.randn((num_draws, *latent_shape), dtype=torch.float32,
                                    generator=image_generator(seed, step, purpose, i))
                        for i in indices], dim=1)


def check_row_offset(row_offset: int, group_size: int) -> None:
    """A rank's rows start at a whole group (so its prompts and pairs line up globally)."""
    if row_offset < 0 or row_offset % group_size:
        raise ValueError(f"row_offset must be a multiple of group_size {group_size} and >= 0 "
                         f"(the rank's first prompt times the group size), got {row_offset}")
