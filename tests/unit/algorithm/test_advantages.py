"""Group advantages: the per-group formula, global and no normalisation, clipping, bad input."""

import pytest
import torch

from chunk_grpo.algorithm.advantages import group_advantages


def test_group_advantages_formula():
    r = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 13.0])
    adv = group_advantages(r, 3, eps=1e-4)
    for g in range(2):
        grp = r[3 * g:3 * g + 3]
        want = (grp - grp.mean()) / (grp.std(unbiased=False) + 1e-4)
        assert torch.allclose(adv[3 * g:3 * g + 3], want)
    # Each group is centred whatever its reward scale.
    assert torch.allclose(adv.view(2, 3).sum(1), torch.zeros(2), atol=1e-5)


def test_global_and_no_normalisation_and_clipping():
    r = torch.tensor([0.0, 1.0, 5.0, 9.0])
    pool = torch.tensor([0.0, 1.0, 5.0, 9.0, 100.0, 200.0])  # gathered from other ranks
    adv = group_advantages(r, 2, norm="global", eps=0.0, all_rewards=pool)
    assert torch.allclose(adv, torch.tensor([-0.5, 0.5, -2.0, 2.0]) / pool.std(unbiased=False))
    assert torch.allclose(group_advantages(r, 2, norm="none"), torch.tensor([-0.5, 0.5, -2, 2]))
    clipped = group_advantages(torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 1]), 8, clip_max=2.0)
    assert float(clipped.max()) == 2.0 and float(clipped.min()) > -2.0
    # An all-equal group gives zero advantages, not NaN.
    assert torch.equal(group_advantages(torch.ones(4), 4), torch.zeros(4))


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="multiple of group_size=3"):
        group_advantages(torch.ones(4), 3)
    with pytest.raises(ValueError, match="norm must be"):
        group_advantages(torch.ones(4), 2, norm="rank")
