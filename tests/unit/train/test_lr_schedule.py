"""The learning-rate schedule: linear warmup, then constant or cosine decay."""

import pytest

from chunk_grpo.train.optim import lr_factor


def test_lr_factor():
    assert [lr_factor(i, warmup_steps=4, total_steps=10) for i in range(5)] == [
        0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_factor(2, warmup_steps=2, total_steps=12, kind="cosine") == 1.0
    assert lr_factor(7, warmup_steps=2, total_steps=12, kind="cosine") == pytest.approx(0.5)
    assert lr_factor(12, warmup_steps=2, total_steps=12, kind="cosine") == pytest.approx(0.0)
    with pytest.raises(ValueError, match="constant"):
        lr_factor(0, warmup_steps=0, total_steps=1, kind="step")
