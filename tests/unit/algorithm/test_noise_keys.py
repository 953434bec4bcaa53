"""World-size-invariant noise: an image's noise is keyed by its global index, so the rows of a
global batch sampled in slices (as ranks sample them, each with its row offset) are the rows
sampled at once."""

import pytest
import torch

from chunk_grpo.algorithm.branching import sample_branch_rollouts
from chunk_grpo.algorithm.noise import check_row_offset, image_generator, initial_noise, step_noise
from chunk_grpo.algorithm.rollout import RolloutSettings, generate, sample_rollouts
from chunk_grpo.evaluate.evaluation import evaluate_policy
from chunk_grpo.models import FluxPolicy

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")

PROMPTS = ["a red circle", "two blue squares", "three green triangles", "a yellow square"]
ROLLOUT = dict(num_steps=3, shift=3.0, kind="flow", eta=0.7, seed=5, batch_size=4)
STEP = 7


@pytest.fixture(scope="module")
def policy(tiny_flux):
    return FluxPolicy.from_pretrained(tiny_flux)


def _assert_same_rows(whole, parts):
    """Bit-identical noise (x_0 and the sampled transitions' start); the rest within float
    noise of the text encoder seeing another batch of prompts."""
    latents = torch.cat([p.latents for p in parts])
    assert torch.equal(latents[:, 0], whole.latents[:, 0])
    finite = ~torch.isnan(whole.latents)
    torch.testing.assert_close(latents[finite], whole.latents[finite], rtol=1e-5, atol=1e-5)
    logps = torch.cat([p.logps for p in parts])
    assert torch.equal(torch.isnan(logps), torch.isnan(whole.logps))
    torch.testing.assert_close(logps.nan_to_num(), whole.logps.nan_to_num(), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize(("shared", "antithetic"),
                         [(False, False), (True, False), (False, True)])
def test_rollout_rows_sampled_in_two_ranks_equal_one(policy, shared, antithetic):
    kw = dict(ROLLOUT, group_size=2, shared_noise=shared, antithetic_noise=antithetic)
    settings = RolloutSettings(**kw)
    whole = sample_rollouts(policy, PROMPTS, settings, step=STEP)  # rows [0, 8)
    first = sample_rollouts(policy, PROMPTS[:2], settings, step=STEP)  # rows [0, 4): rank 0
    second = sample_rollouts(policy, PROMPTS[2:], settings, step=STEP,
                             row_offset=4)  # rows [4, 8): rank 1
    _assert_same_rows(whole, [first, second])
    x0 = whole.latents[:, 0]
    if shared:  # one noise per prompt, keyed by the global prompt index
        assert torch.equal(x0[0], x0[1]) and not torch.equal(x0[1], x0[2])
    elif antithetic:
        assert torch.equal(x0[1::2], -x0[0::2])
    # a rank that forgot its offset samples other images than the global batch's
    wrong = sample_rollouts(policy, PROMPTS[2:], settings, step=STEP, row_offset=0)
    assert not torch.equal(wrong.latents[:, 0], whole.latents[4:, 0])


def test_branch_rows_sampled_in_two_ranks_equal_one(policy):
    settings = RolloutSettings(**ROLLOUT, group_size=2, antithetic_noise=True)
    kw = dict(branch_step=1, granularities=(1, 2), step=STEP)
    whole, whole_images = sample_branch_rollouts(policy, PROMPTS, settings, row_offset=0, **kw)
    first, first_images = sample_branch_rollouts(policy, PROMPTS[:2], settings, row_offset=0,
                                                 **kw)
    second, second_images = sample_branch_rollouts(policy, PROMPTS[2:], settings, row_offset=4,
                                                   **kw)
    _assert_same_rows(whole, [first, second])
    for i in range(2):
        torch.testing.assert_close(torch.cat([first_images[i], second_images[i]]),
                                   whole_images[i], rtol=1e-5, atol=1e-5)


def test_generation_and_evaluation_split_by_image_index(policy):
    kw = dict(num_steps=3, sampler="flow", eta=0.7, seed=3, batch_size=3)
    whole = generate(policy, PROMPTS[:3] * 2, **kw)
    parts = [generate(policy, PROMPTS[:3], index_offset=0, **kw),
             generate(policy, PROMPTS[:3], index_offset=3, **kw)]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(parts[0], parts[1])  # same prompts, other images' noise
    # evaluate_policy: image i of prompt p is global image index_offset + p * N + i
    ev = dict(num_steps=2, seed=4, images_per_prompt=2, batch_size=2,
              reward="test_brightness")
    all_at_once = evaluate_policy(policy, PROMPTS, **ev)
    halves = [evaluate_policy(policy, PROMPTS[:2], index_offset=0, **ev),
              evaluate_policy(policy, PROMPTS[2:], index_offset=4, **ev)]
    torch.testing.assert_close(torch.cat([h.images for h in halves]), all_at_once.images,
                               rtol=1e-5, atol=1e-5)


def test_keys_separate_seed_step_purpose_and_index(policy):
    def draw(*key):
        return torch.randn(4, generator=image_generator(*key))

    base = draw(0, 1, "initial", 2)
    assert torch.equal(base, draw(0, 1, "initial", 2))
    for other in [(1, 1, "initial", 2), (0, 2, "initial", 2), (0, 1, "steps", 2),
                  (0, 1, "initial", 3)]:
        assert not torch.equal(base, draw(*other))
    # initial noise: row i is FluxPipeline's draw for a batch of one with image i's generator
    rows = initial_noise(policy, [2, 0], seed=0, step=1)
    torch.testing.assert_close(rows[0:1], policy.initial_noise(1, image_generator(0, 1,
                                                                                  "initial", 2)))
    draws = step_noise([4, 5], (16, 16), 3, seed=0)
    assert draws.shape == (3, 2, 16, 16)
    torch.testing.assert_close(draws[:, 1], torch.randn((3, 16, 16),
                                                        generator=image_generator(0, 0, "steps",
                                                                                  5)))


def test_bad_offsets_name_the_fix(policy):
    with pytest.raises(ValueError, match="row_offset must be a multiple of group_size 4"):
        check_row_offset(6, 4)
    with pytest.raises(ValueError, match="row_offset must be a multiple"):
        sample_rollouts(policy, PROMPTS[:1], RolloutSettings(**ROLLOUT, group_size=2),
                        step=STEP, row_offset=3)
    with pytest.raises(ValueError, match="index_offset must be >= 0"):
        generate(policy, PROMPTS[:1], num_steps=2, index_offset=-1)
    with pytest.raises(ValueError, match="image index must be >= 0"):
        image_generator(0, 0, "initial", -1)
