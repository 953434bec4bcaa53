"""The two training samplers (Chunk-GRPO's group rollouts, G2RPO's branches) through the one
interface `collect_batch` uses: chosen from the config, each gives what its sampling function
gives for the same settings, and scores every granularity."""

import pytest
import torch
from trainer_utils import tiny_config

from chunk_grpo.algorithm.branching import sample_branch_rollouts
from chunk_grpo.algorithm.chunking import ChunkLayout
from chunk_grpo.algorithm.rollout import RolloutSettings, sample_rollouts
from chunk_grpo.algorithm.samplers import BranchSampler, GroupSampler, Sampler
from chunk_grpo.models import FluxPolicy
from chunk_grpo.rewards.scoring import RolloutScorer
from chunk_grpo.train.setup import build_sampler, resolve_reward, rollout_settings

PROMPTS = ["a red circle", "two blue squares"]

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")


@pytest.fixture(scope="module")
def model(tiny_flux):
    path = tiny_flux
    return path, FluxPolicy.from_pretrained(path)


def _direct(policy, settings: RolloutSettings, algorithm: str, chunks: list[int], step: int):
    """The sampling function the sampler stands for, called by hand."""
    if algorithm == "g2rpo":
        rollout, finishes = sample_branch_rollouts(policy, PROMPTS, settings,
                                                   branch_step=chunks[0],
                                                   granularities=(1, 3), step=step)
        return rollout, finishes
    rollout = sample_rollouts(policy, PROMPTS, settings, step=step)
    return rollout, [rollout.images]


@pytest.mark.parametrize(("algorithm", "kind"),
                         [("chunk_grpo", GroupSampler), ("g2rpo", BranchSampler)])
def test_both_samplers_through_one_interface(model, tmp_path, algorithm, kind):
    path, policy = model
    cfg = tiny_config(path, tmp_path / "run", {"sampling.algorithm": algorithm,
                                               "sampling.g2rpo_granularities": "1,3",
                                               "chunks.spec": "1,3",
                                               "chunks.fraction": 0.5,
                                               "sampling.shared_noise": True})
    sampler: Sampler = build_sampler(cfg, policy)
    assert type(sampler) is kind and sampler.settings == rollout_settings(cfg, policy)
    assert sampler.settings.validate is False  # the config is checked
    with pytest.raises(AttributeError):  # frozen: built once
        sampler.settings.eta = 0.1
    # the layout: G2RPO fixes a step-level one, the group sampler takes the config's
    fixed = sampler.layout(cfg.num_trained)
    layout = fixed or ChunkLayout((1, 3))
    assert fixed == (ChunkLayout((1,) * 4) if algorithm == "g2rpo" else None)
    gen = torch.Generator().manual_seed(0)
    chunks = sampler.choose_chunks(layout, cfg.chunks.fraction, None, gen)
    assert len(chunks) == 1 and 0 <= chunks[0] < layout.num_chunks  # 1 of 2 chunks / 1 step

    reward = resolve_reward(cfg, torch.device("cpu"))
    with RolloutScorer(reward, overlap=True) as scorer:
        sampled = sampler.sample(policy, PROMPTS, chunks, step=3, row_offset=0, scorer=scorer)
        row_prompts = [PROMPTS[i] for i in sampled.rollout.prompt_index.tolist()]
        components = sampler.score(sampled, scorer, row_prompts)

    rollout, images = _direct(policy, sampler.settings, algorithm, chunks, step=3)
    assert torch.equal(sampled.rollout.latents.nan_to_num(), rollout.latents.nan_to_num())
    assert torch.equal(sampled.rollout.logps.nan_to_num(), rollout.logps.nan_to_num())
    assert torch.equal(sampled.rollout.images, rollout.images)
    # one score dict per granularity, each the reward of that finish's images
    assert len(components) == len(sampler.granularities) == len(images)
    for scores, finish in zip(components, images, strict=True):
        want = reward.score(finish, row_prompts)
        assert scores.keys() == want.keys()
        for label in want:
            assert torch.equal(scores[label], want[label])
    # the trained chunk's transitions were sampled: finite log-probs
    steps = layout.steps(chunks[0])
    assert torch.isfinite(sampled.rollout.logps[:, steps]).all()
    assert sampled.rollout.latents.shape[0] == len(PROMPTS) * cfg.sampling.group_size
