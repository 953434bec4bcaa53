"""Chunks: consecutive trained transitions optimised as one unit, and which chunks to train.

The T-1 trained transitions (index 0 = highest noise; the last transition into sigma=0 is not
trained) are split into chunks of sizes cs_1..cs_K with sum T-1. Sizes come from an explicit list,
a fixed size, step level (all 1), sequence level (one chunk), or "auto": boundaries placed where
the temporal-dynamics curve L1rel(t) changes regime.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from chunk_grpo.config.specs import ChunkSpecError, chunk_sizes


@dataclass(frozen=True)
class ChunkLayout:
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.sizes or any(int(s) < 1 for s in self.sizes):
            raise ChunkSpecError(f"chunk sizes must be positive integers, got {self.sizes}")

    @property
    def num_chunks(self) -> int:
        return len(self.sizes)

    @property
    def num_trained(self) -> int:
        return sum(self.sizes)

    @property
    def starts(self) -> tuple[int, ...]:
        out, pos = [], 0
        for s in self.sizes:
            out.append(pos)
            pos += s
        return tuple(out)

    def steps(self, chunk: int) -> list[int]:
        """The transition indices of chunk ``chunk`` (x_t -> x_{t+1} for t in the list)."""
        start = self.starts[chunk]
        return list(range(start, start + self.sizes[chunk]))

    def chunk_weights(self, curve: torch.Tensor) -> torch.Tensor:
        """Mean of the dynamics curve inside each chunk (the weighted-sampling weights)."""
        return torch.stack([curve[self.steps(j)].float().mean() for j in range(self.num_chunks)])


def parse_chunk_spec(spec: str, num_trained: int, chunk_size: int | None = None
                     ) -> ChunkLayout | None:
    """A layout for ``num_trained`` transitions, or None for "auto" (needs the profile).

    spec: "2,3,4,7" (sizes summing to num_trained), "step", "sequence" or "auto".
    chunk_size: fixed-size chunks (the last one takes the remainder); overrides spec.
    The syntax is `specs.chunk_sizes`' (torch-free, so the configuration checks it early).
    """
    sizes = chunk_sizes(spec, num_trained, chunk_size)
    return None if sizes is None else ChunkLayout(sizes)


def relative_change(latents: torch.Tensor) -> torch.Tensor:
    """L1rel(t) = mean|x_{t+1} - x_t| / (mean|x_t| + 1e-8), averaged over samples.

    latents: [B, T+1, ...] trajectories; returns [T] float32.
    """
    return per_trajectory_change(latents).mean(dim=0)


def per_trajectory_change(latents: torch.Tensor) -> torch.Tensor:
    """L1rel(t) of each trajectory: [B, T] float32."""
    x = latents.float().flatten(2)
    diff = (x[:, 1:] - x[:, :-1]).abs().mean(dim=2)
    scale = x[:, :-1].abs().mean(dim=2) + 1e-8
    return diff / scale


def segment_by_dynamics(curve: torch.Tensor, *, max_size: int = 5, min_size: int = 2,
                        d2_fraction: float = 0.1) -> ChunkLayout:
    """Split the curve's steps where its regime changes, favouring small chunks.

    Candidate boundaries: the curve's extrema (sign changes of the first difference) and the
    extrema of its second difference whose magnitude is at least ``d2_fraction`` of the largest
    (and above rounding noise).
    Chunks shorter than ``min_size`` merge into their smaller neighbour; chunks longer than
    ``max_size`` are split into near-equal parts.
    """
    c = curve.double().flatten()
    n = c.numel()
    if n <= min_size:
        return ChunkLayout((n,))
    bounds: set[int] = set()
    d1 = c[1:] - c[:-1]
    for i in range(len(d1) - 1):
        if d1[i] * d1[i + 1] < 0:
            bounds.add(i + 1)
    d2 = d1[1:] - d1[:-1]  # d2[j] is centred on step j + 1
    if len(d2) >= 3:
        # Ignore rounding-level wiggles: relative to the largest bend and to the curve's scale.
        floor = max(d2_fraction * float(d2.abs().max()), 1e-3 * float(c.abs().max()))
        for j in range(1, len(d2) - 1):
            is_max = d2[j] > d2[j - 1] and d2[j] >= d2[j + 1]
            is_min = d2[j] < d2[j - 1] and d2[j] <= d2[j + 1]
            if (is_max or is_min) and abs(d2[j]) >= floor:
                bounds.add(j + 1)
    edges = [0] + sorted(b for b in bounds if 0 < b < n) + [n]
    sizes = [b - a for a, b in zip(edges[:-1], edges[1:], strict=True)]
    sizes = _merge_small(sizes, min_size)
    out: list[int] = []
    for s in sizes:
        parts = math.ceil(s / max_size)
        base, extra = divmod(s, parts)
        out.extend([base + 1] * extra + [base] * (parts - extra))
    return ChunkLayout(tuple(out))


def _merge_small(sizes: list[int], min_size: int) -> list[int]:
    sizes = list(sizes)
    while len(sizes) > 1:
        small = [i for i, s in enumerate(sizes) if s < min_size]
        if not small:
            break
        i = small[0]
        if i == 0:
            j = 1
        elif i == len(sizes) - 1:
            j = i - 1
        else:
            j = i - 1 if sizes[i - 1] <= sizes[i + 1] else i + 1
        lo, hi = min(i, j), max(i, j)
        sizes[lo:hi + 1] = [sizes[lo] + sizes[hi]]
    return sizes


def select_chunks(num_chunks: int, fraction: float, *, weights: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> list[int]:
    """Chunks trained this iteration: round(fraction * K) (at least 1), without replacement.

    With ``weights`` the draw is proportional to them (weighted sampling); else uniform.
    Returned in increasing order (high noise first).
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    k = max(1, min(num_chunks, round(fraction * num_chunks)))
    if k == num_chunks:
        return list(range(num_chunks))
    if weights is None:
        probs = torch.ones(num_chunks, dtype=torch.float64)
    else:
        probs = weights.detach().double().cpu().clamp_min(0)
        if probs.numel() != num_chunks or not torch.isfinite(probs).all() or probs.sum() <= 0:
            raise ValueError(f"weights must be {num_chunks} finite non-negative numbers "
                             f"with a positive sum, got {weights}")
    picked = torch.multinomial(probs, k, replacement=False, generator=generator)
    return sorted(int(i) for i in picked)
