"""The training samplers: Chunk-GRPO's group rollouts and G2RPO's branches as two
implementations of one interface (`Sampler`), chosen once from the config when the trainer is
built (`chunk_grpo.train.setup.build_sampler`). `chunk_grpo.train.loop.collect_batch` calls the
interface only:

  1. `choose_chunks`: the chunks this iteration trains, drawn before sampling (G2RPO branches
     at the step it trains);
  2. `sample`: the rollout, with the images that still need scoring (G2RPO's finishes; the
     group sampler hands each batch to the scorer as it is decoded);
  3. `score`: each finish's reward components, one dict per granularity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from chunk_grpo.algorithm.branching import sample_branch_rollouts
from chunk_grpo.algorithm.chunking import ChunkLayout, select_chunks
from chunk_grpo.algorithm.rollout import Rollout, RolloutSettings, sample_rollouts

if TYPE_CHECKING:  # the samplers only call the scorer they are given; no rewards imported
    from chunk_grpo.rewards.scoring import RolloutScorer


@dataclass
class Sampled:
    """A sampler's rollout and the images it left to score (one tensor per granularity)."""

    rollout: Rollout
    unscored: list[torch.Tensor]


class Sampler(Protocol):
    """What the training loop needs of a rollout sampler."""

    settings: RolloutSettings
    # The strides every row is finished at (the first gives the rollout's images): (1,) for a
    # sampler whose images are its trajectories' own ends.
    granularities: tuple[int, ...]

    def layout(self, num_trained: int) -> ChunkLayout | None:
        """The chunk layout the sampler fixes, or None: the config's."""
        ...

    def choose_chunks(self, layout: ChunkLayout, fraction: float,
                      weights: torch.Tensor | None, generator: torch.Generator) -> list[int]:
        """The chunks trained this iteration (``fraction``: the config's share of them)."""
        ...

    def sample(self, policy, prompts: list[str], chunks: list[int], *, step: int,
               row_offset: int, scorer: RolloutScorer) -> Sampled:
        """The iteration's rollout of ``prompts`` (this rank's rows start at ``row_offset``)."""
        ...

    def score(self, sampled: Sampled, scorer: RolloutScorer,
              row_prompts: list[str]) -> list[dict[str, torch.Tensor]]:
        """Each granularity's reward components, the rollout's own images first."""
        ...


@dataclass(frozen=True)
class GroupSampler:
    """Chunk-GRPO: G SDE trajectories per prompt, every transition sampled (or the first
    ``sde_window``); each batch is scored while the next is sampled."""

    settings: RolloutSettings
    granularities: tuple[int, ...] = (1,)

    def layout(self, num_trained: int) -> ChunkLayout | None:
        return None

    def choose_chunks(self, layout: ChunkLayout, fraction: float,
                      weights: torch.Tensor | None, generator: torch.Generator) -> list[int]:
        return select_chunks(layout.num_chunks, fraction, weights=weights, generator=generator)

    def sample(self, policy, prompts: list[str], chunks: list[int], *, step: int,
               row_offset: int, scorer: RolloutScorer) -> Sampled:
        rollout = sample_rollouts(policy, prompts, self.settings, step=step,
                                  row_offset=row_offset, on_batch=scorer)
        return Sampled(rollout, [])

    def score(self, sampled: Sampled, scorer: RolloutScorer,
              row_prompts: list[str]) -> list[dict[str, torch.Tensor]]:
        return [scorer.collect()]


@dataclass(frozen=True)
class BranchSampler:
    """G2RPO: one ODE prefix per prompt, G stochastic branches at the one step trained (a
    step-level chunk), each finished by the ODE at every stride of ``granularities``."""

    settings: RolloutSettings
    granularities: tuple[int, ...]

    def layout(self, num_trained: int) -> ChunkLayout | None:
        return ChunkLayout((1,) * num_trained)  # chunk j = step j

    def choose_chunks(self, layout: ChunkLayout, fraction: float,
                      weights: torch.Tensor | None, generator: torch.Generator) -> list[int]:
        # one step, drawn as chunks are; the config's fraction does not apply
        return select_chunks(layout.num_chunks, 1 / layout.num_chunks, weights=weights,
                             generator=generator)

    def sample(self, policy, prompts: list[str], chunks: list[int], *, step: int,
               row_offset: int, scorer: RolloutScorer) -> Sampled:
        rollout, finishes = sample_branch_rollouts(
            policy, prompts, self.settings, branch_step=chunks[0],
            granularities=self.granularities, step=step, row_offset=row_offset)
        return Sampled(rollout, finishes)

    def score(self, sampled: Sampled, scorer: RolloutScorer,
              row_prompts: list[str]) -> list[dict[str, torch.Tensor]]:
        return [scorer.score_now(images, row_prompts) for images in sampled.unscored]
