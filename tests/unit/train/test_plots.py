"""PIL line plots: round ticks that cover the data, labelled axes, errors on empty data; the
temporal-dynamics profile with the chunks of the layout a run uses."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from chunk_grpo.algorithm.chunking import ChunkLayout
from chunk_grpo.train.plots import (
    CHUNK_TINTS,
    UNTRAINED_TINT,
    line_plot,
    nice_ticks,
    plot_profile,
    profile_marks,
)


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


def _boundary_columns(path) -> list[int]:
    """The x of every red vertical line in the plot area (a column red over 50+ rows)."""
    pixels = np.asarray(Image.open(path).convert("RGB"))[:420]
    red = (pixels == (214, 39, 40)).all(axis=2).sum(axis=0)
    return [int(x) for x in np.flatnonzero(red > 50)]


@pytest.mark.parametrize("sizes, bounds", [((3,), [2.5]), ((2, 3, 4), [1.5, 4.5, 8.5]),
                                           ((4, 5), [3.5, 8.5])])
def test_the_profile_draws_the_chunks_of_the_layout_used(tmp_path, sizes, bounds):
    # 10 sampling steps: the layout trains the first sum(sizes) transitions, the rest are grey
    curve = torch.linspace(0.3, 0.1, 10)
    marks, bands = profile_marks(ChunkLayout(sizes), 10)
    assert marks == bounds  # after every chunk, unless it ends at the last step
    assert [b[2] for b in bands] == [f"chunk {j}" for j in range(len(sizes))] + (
        ["not trained"] if sum(sizes) < 10 else [])
    assert bands[0][:2] == (-0.5, sizes[0] - 0.5)
    path = plot_profile(curve, ChunkLayout(sizes), tmp_path / "profile.png")
    assert len(_boundary_columns(path)) == len(bounds)
    pixels = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3)
    for tint in (*CHUNK_TINTS[:min(2, len(sizes))], UNTRAINED_TINT):
        assert (pixels == tint).all(1).any()


def test_a_layout_over_every_step_has_no_grey_and_no_trailing_boundary(tmp_path):
    marks, bands = profile_marks(ChunkLayout((2, 3)), 5)
    assert marks == [1.5] and [b[2] for b in bands] == ["chunk 0", "chunk 1"]
