"""PIL line plots: round ticks that cover the data, labelled axes, errors on empty data."""

import math

import numpy as np
import pytest
from PIL import Image

from chunk_grpo.plots import line_plot, nice_ticks


@pytest.mark.parametrize("low, high", [(0.0, 1.0), (0.013, 0.21), (-3.0, 17.0), (5.0, 5.0)])
def test_ticks_are_round_and_cover_the_range(low, high):
    ticks = nice_ticks(low, high)
    assert ticks[0] <= low and ticks[-1] >= high and 3 <= len(ticks) <= 12
    steps = np.diff(ticks)
    assert np.allclose(steps, steps[0])
    mantissa = steps[0] / 10 ** math.floor(math.log10(steps[0]))
    assert any(math.isclose(mantissa, m) for m in (1, 2, 5))


def test_plot_draws_series_and_boundaries(tmp_path):
    series = {"a": ([0, 1, 2], [0.1, 0.3, 0.2]), "b": ([0, 1, 2], [0.2, float("nan"), 0.1])}
    path = line_plot(series, tmp_path / "p.png", title="t", xlabel="step", ylabel="reward",
                     vlines=[0.5], vline_label="boundary")
    pixels = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3)
    for colour in ((31, 119, 180), (255, 127, 14), (214, 39, 40)):
        assert (pixels == colour).all(1).any()


def test_plot_refuses_no_data(tmp_path):
    with pytest.raises(ValueError, match="at least one series"):
        line_plot({}, tmp_path / "p.png", title="", xlabel="", ylabel="")
    with pytest.raises(ValueError, match="NaN or infinite"):
        line_plot({"a": ([0.0], [float("nan")])}, tmp_path / "p.png", title="", xlabel="",
                  ylabel="")
