"""The closing summary: paired before -> after numbers and a verdict that follows the CI."""

from pathlib import Path

import pytest
import torch

from chunk_grpo.evaluation import EvalResult
from chunk_grpo.stats import mean_ci95
from chunk_grpo.summary import Comparison, summary_text


def result(rewards: list[float], attributes: dict | None = None) -> EvalResult:
    r = torch.tensor(rewards)
    mean, ci = mean_ci95(r)
    return EvalResult(mean, ci, len(rewards), r, [f"p{i}" for i in range(len(rewards))],
                      torch.zeros(len(rewards), 3, 4, 4), attributes or {})


def test_comparison_is_paired_image_by_image():
    base = result([0.1, 0.5, 0.9, 0.3], {"colour_acc": 0.5, "count_acc": 0.25})
    after = result([0.2, 0.6, 1.0, 0.3], {"colour_acc": 0.75, "count_acc": 0.25})
    c = Comparison.of("eval", base, after)
    assert c.gain == pytest.approx(0.075) and c.changed_fraction == 0.75
    diff_mean, diff_ci = mean_ci95(after.rewards.double() - base.rewards.double())
    assert (c.gain, c.gain_ci95) == pytest.approx((diff_mean, diff_ci))
    text = summary_text(run_dir=Path("runs/x"), reward="shapes", comparisons=[c], iterations=10,
                        minutes=2.0, hybrid_steps=8, model_dir=Path("runs/x/final_model"))
    assert "before 0.450" in text and "after 0.525" in text
    assert "colour 0.50->0.75" in text and "count 0.25->0.25" in text
    assert "12.00 s per iteration" in text and "--resume runs/x" in text
    assert ("beyond noise" in text) == c.significant


def test_a_clear_gain_is_called_one_and_other_prompts_are_refused():
    base = result([0.1 * i for i in range(10)])
    after = result([0.1 * i + 0.05 for i in range(10)])
    c = Comparison.of("eval", base, after)
    assert c.significant and c.gain == pytest.approx(0.05)
    text = summary_text(run_dir=Path("r"), reward="shapes", comparisons=[c], iterations=1,
                        minutes=1.0, hybrid_steps=0, model_dir=None)
    assert "up, beyond noise" in text
    other = result([0.1] * 10)
    other.prompts = [f"q{i}" for i in range(10)]
    with pytest.raises(ValueError, match="same prompts"):
        Comparison.of("eval", base, other)
