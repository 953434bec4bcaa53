"""The shifted FLUX sigma schedule and its resolution-dependent shift."""

import math

import pytest
import torch

from chunk_grpo.algorithm.sigmas import dynamic_shift, flux_sigmas


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
