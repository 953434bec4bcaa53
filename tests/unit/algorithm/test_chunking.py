"""Chunk specs, the temporal-dynamics segmentation and weighted chunk selection."""

import pytest
import torch

from chunk_grpo.algorithm.chunking import (
    ChunkLayout,
    parse_chunk_spec,
    relative_change,
    segment_by_dynamics,
    select_chunks,
)
from chunk_grpo.config.specs import ChunkSpecError


@pytest.mark.parametrize(
    ("spec", "chunk_size", "sizes"),
    [
        ("2,3,4,7", None, (2, 3, 4, 7)),
        (" 2, 3,4 ,7 ", None, (2, 3, 4, 7)),
        ("step", None, (1,) * 16),
        ("sequence", None, (16,)),
        ("auto", 4, (4, 4, 4, 4)),  # a fixed size overrides the spec
        ("auto", 5, (5, 5, 5, 1)),  # the last chunk takes the remainder
        ("auto", 1, (1,) * 16),
    ],
)
def test_parse_chunk_spec(spec, chunk_size, sizes):
    layout = parse_chunk_spec(spec, 16, chunk_size)
    assert layout.sizes == sizes
    assert layout.num_trained == 16


def test_auto_spec_needs_the_profile():
    assert parse_chunk_spec("auto", 16) is None


@pytest.mark.parametrize(
    ("spec", "chunk_size", "match"),
    [
        ("2,3,4", None, "sum to 9 but there are 16"),
        ("2,3,x", None, "comma-separated sizes"),
        ("0,16", None, ">= 1"),
        ("2,-2,16", None, ">= 1"),
        ("", None, "comma-separated sizes"),
        ("auto", 0, "chunk_size must be >= 1"),
    ],
)
def test_invalid_chunk_specs(spec, chunk_size, match):
    with pytest.raises(ChunkSpecError, match=match):
        parse_chunk_spec(spec, 16, chunk_size)
    assert issubclass(ChunkSpecError, ValueError)


def test_layout_steps_and_weights():
    layout = ChunkLayout((2, 3, 1))
    assert layout.starts == (0, 2, 5)
    assert [layout.steps(j) for j in range(3)] == [[0, 1], [2, 3, 4], [5]]
    curve = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0, 7.0])
    assert torch.allclose(layout.chunk_weights(curve), torch.tensor([2.0, 3.0, 7.0]))
    with pytest.raises(ChunkSpecError):
        ChunkLayout((2, 0))


def test_relative_change_matches_formula():
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(3, 5, 4, 2, generator=g)
    got = relative_change(lat)
    want = torch.zeros(4)
    for t in range(4):
        per = [(lat[b, t + 1] - lat[b, t]).abs().mean() / (lat[b, t].abs().mean() + 1e-8)
               for b in range(3)]
        want[t] = torch.stack(per).mean()
    assert torch.allclose(got, want, atol=1e-6)


def test_segmentation_splits_at_regime_changes():
    # Three regimes: a decay, a flat plateau, a rise. Boundaries belong where they meet.
    curve = torch.tensor([0.9, 0.6, 0.4, 0.3, 0.3, 0.3, 0.3, 0.3, 0.4, 0.6, 0.9, 1.3])
    layout = segment_by_dynamics(curve, max_size=5)
    assert layout.num_trained == 12
    assert max(layout.sizes) <= 5 and min(layout.sizes) >= 2
    starts = set(layout.starts)
    assert starts & {2, 3, 4}, layout.sizes  # the decay ends around step 3
    assert starts & {7, 8, 9}, layout.sizes  # the rise starts around step 8


def test_segmentation_limits_and_smooth_curves():
    # A straight line has no regime change: only the size limit splits it, evenly.
    layout = segment_by_dynamics(torch.linspace(1, 0, 15), max_size=5)
    assert layout.sizes == (5, 5, 5)
    assert segment_by_dynamics(torch.tensor([1.0, 2.0]), max_size=5).sizes == (2,)
    noisy = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0, 1, 0], dtype=torch.float32)
    assert min(segment_by_dynamics(noisy, max_size=4).sizes) >= 2  # tiny chunks are merged


def test_select_chunks_counts_and_order():
    g = torch.Generator().manual_seed(0)
    assert select_chunks(4, 1.0, generator=g) == [0, 1, 2, 3]
    picked = select_chunks(4, 0.5, generator=g)
    assert len(picked) == 2 and picked == sorted(picked) and len(set(picked)) == 2
    assert len(select_chunks(16, 0.5, generator=g)) == 8
    assert len(select_chunks(3, 0.01, generator=g)) == 1  # at least one chunk
    with pytest.raises(ValueError, match="fraction"):
        select_chunks(4, 0.0)


def test_weighted_selection_follows_the_weights():
    g = torch.Generator().manual_seed(0)
    weights = torch.tensor([8.0, 1.0, 1.0, 0.0])
    counts = torch.zeros(4)
    for _ in range(400):
        for j in select_chunks(4, 0.25, weights=weights, generator=g):
            counts[j] += 1
    assert counts[3] == 0
    assert 0.7 < counts[0] / 400 < 0.9  # expected 0.8
    with pytest.raises(ValueError, match="weights"):
        select_chunks(4, 0.5, weights=torch.tensor([1.0, float("nan"), 1.0, 1.0]))
    with pytest.raises(ValueError, match="weights"):
        select_chunks(4, 0.5, weights=torch.tensor([1.0, 1.0]))
