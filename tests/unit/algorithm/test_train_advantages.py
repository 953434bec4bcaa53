"""Group advantages, the shifted sigma schedule and the learning-rate schedule."""

import math

import pytest
import torch

from chunk_grpo.algorithm.advantages import group_advantages
from chunk_grpo.algorithm.sigmas import dynamic_shift, flux_sigmas
from chunk_grpo.train.optim import lr_factor


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


def test_flux_sigmas_shifted():
    s = flux_sigmas(4, shift=3.0)
    base = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    assert torch.allclose(s, 3 * base / (1 + 2 * base))
    assert s.dtype == torch.float32 and s[0] == 1 and s[-1] == 0
    assert torch.allclose(flux_sigmas(4, shift=1.0), base)
    assert bool((s[1:] < s[:-1]).all())
    with pytest.raises(ValueError, match="num_steps"):
        flux_sigmas(0)
    assert dynamic_shift(256) == pytest.approx(math.exp(0.5))
    assert dynamic_shift(4096) == pytest.approx(math.exp(1.15))


def test_lr_factor():
    assert [lr_factor(i, warmup_steps=4, total_steps=10) for i in range(5)] == [
        0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_factor(2, warmup_steps=2, total_steps=12, kind="cosine") == 1.0
    assert lr_factor(7, warmup_steps=2, total_steps=12, kind="cosine") == pytest.approx(0.5)
    assert lr_factor(12, warmup_steps=2, total_steps=12, kind="cosine") == pytest.approx(0.0)
    with pytest.raises(ValueError, match="constant"):
        lr_factor(0, warmup_steps=0, total_steps=1, kind="step")
