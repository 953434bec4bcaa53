"""The closing summary: paired before -> after numbers and a verdict that follows the CI, the
guard reward beside the trained one, the chunks trained, and the guard's early-stop rule."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from chunk_grpo.evaluate.evaluation import EvalResult
from chunk_grpo.evaluate.stats import mean_ci95
from chunk_grpo.rewards.guard import Guard, stop_reason
from chunk_grpo.rewards.mix import as_reward_mix
from chunk_grpo.train.summary import (
    ChunkReport,
    Comparison,
    direction,
    guard_verdict,
    paired_gain,
    save_summary,
    summary_numbers,
    summary_text,
)


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


# ----------------------------------------------------------------------------- the guard

def guarded(rewards: list[float], guard: list[float]) -> EvalResult:
    res = result(rewards)
    res.guard_scores = torch.tensor(guard)
    return res


def test_paired_gain_and_direction_follow_the_ci():
    before, after = torch.tensor([0.1, 0.5, 0.9, 0.3]), torch.tensor([0.2, 0.5, 1.0, 0.305])
    gain, ci, changed = paired_gain(before, after)
    assert (gain, ci) == pytest.approx(mean_ci95(after.double() - before.double()))
    assert changed == 0.5  # two images moved by more than 0.01
    assert direction(0.05, 0.01) == "up" and direction(-0.05, 0.01) == "down"
    assert direction(0.05, 0.06) == "flat" and direction(0.05, float("nan")) == "flat"


@pytest.mark.parametrize("reward, guard, verdict", [
    ((0.5, 0.1), (-0.4, 0.1), "reward up, shapes down: reward hacking"),
    ((0.5, 0.1), (0.0, 0.1), "reward up, shapes within noise: a gain that kept shapes"),
    ((0.5, 0.1), (0.3, 0.1), "reward up, shapes up: both improved"),
    ((0.0, 0.1), (-0.4, 0.1), "reward within noise, shapes down: shapes lost for no gain"),
    ((0.0, 0.1), (0.0, 0.1), "reward and shapes within noise: no measurable change"),
    ((-0.5, 0.1), (-0.4, 0.1), "reward down, shapes down: training hurt both"),
])
def test_the_verdict_reads_both_gains_by_their_own_ci(reward, guard, verdict):
    assert guard_verdict(*reward, *guard, "shapes") == verdict


def test_a_guard_that_falls_beyond_noise_while_the_reward_rises_is_reward_hacking(tmp_path):
    # the reward rises on every image by 0.2 (+-0.01), the guard falls by 0.3 (+-0.01)
    base = guarded([0.1 * i for i in range(8)], [0.8 + 0.01 * (i % 2) for i in range(8)])
    after = guarded([0.1 * i + 0.2 + 0.01 * (i % 2) for i in range(8)],
                    [0.5 + 0.02 * (i % 2) for i in range(8)])
    c = Comparison.of("eval", base, after, guard="shapes")
    g = c.guard
    assert g.name == "shapes" and g.n == 8 and g.changed_fraction == 1.0
    assert (g.gain, g.gain_ci95) == pytest.approx(paired_gain(base.guard_scores,
                                                              after.guard_scores)[:2])
    assert g.before == pytest.approx(0.805) and g.after == pytest.approx(0.51)
    assert c.verdict == "reward up, shapes down: reward hacking"
    chunks = ChunkReport(sizes=[2, 3, 4], trained=[12, 25, 13], iterations=25, per_iteration=2,
                         weighted=False, sampling_steps=10)
    reason = "the time budget ran out (run.max_minutes 10) after 25 of run.max_steps 400"
    text = summary_text(run_dir=Path("r"), reward="jpeg", comparisons=[c], iterations=25,
                        minutes=10.0, hybrid_steps=0, model_dir=None, chunks=chunks,
                        stopped=reason)
    assert "guard     shapes before 0.805 +- 0.004   ->   after 0.510 +- 0.009" in text
    assert "paired gain -0.295 (95% CI" in text and "down, beyond noise" in text
    assert "verdict   reward up, shapes down: reward hacking" in text
    assert "stopped   the time budget ran out (run.max_minutes 10) after 25 of" in text
    assert "chunks    [2, 3, 4] over steps 0-1 | 2-4 | 5-8 (of 10 sampling steps)" in text
    assert "2 of 3 chunks per iteration, drawn uniformly" in text
    assert "times trained over 25 iterations: 0: 12, 1: 25, 2: 13" in text
    lines = text.splitlines()
    added = lines[lines.index("chunk-grpo run finished: r") + 3:][:2] + lines[
        next(i for i, line in enumerate(lines) if line.startswith("guard")):][:6]
    assert all(len(line) <= 80 for line in added), added
    save_summary(tmp_path, text, [c], chunks, reason)
    data = json.loads((tmp_path / "summary.json").read_text())
    assert set(data) == {"eval", "chunks", "stopped"} and data["stopped"] == reason
    assert data["eval"]["guard"]["gain"] == pytest.approx(g.gain)
    assert data["eval"]["verdict"] == "reward up, shapes down: reward hacking"
    assert data["chunks"]["trained"] == [12, 25, 13]
    assert data["chunks"]["steps"] == [[0, 1], [2, 4], [5, 8]]
    numbers = summary_numbers([c], chunks)
    assert numbers["final/eval/guard/gain"] == pytest.approx(g.gain)
    assert numbers["final/chunks/trained_1"] == 25


def test_without_a_guard_there_is_no_verdict():
    c = Comparison.of("eval", guarded([0.1, 0.2], [1.0, 1.0]), result([0.2, 0.3]),
                      guard="shapes")
    assert c.guard is None and c.verdict is None  # the trained model's guard is missing
    assert Comparison.of("eval", guarded([0.1, 0.2], [1.0, 1.0]),
                         guarded([0.2, 0.3], [1.0, 1.0])).guard is None  # none named
    text = summary_text(run_dir=Path("r"), reward="jpeg", comparisons=[c], iterations=1,
                        minutes=1.0, hybrid_steps=0, model_dir=None)
    assert "verdict" not in text and "guard" not in text and "stopped" not in text


def test_chunk_lines_say_how_chunks_were_drawn_and_wrap():
    every = ChunkReport(sizes=[3], trained=[40], iterations=40, per_iteration=1,
                        weighted=False, sampling_steps=10)
    assert every.lines()[:2] == ["chunks    [3] over steps 0-2 (of 10 sampling steps)",
                                 "          all 1 chunk(s) every iteration"]
    steps = ChunkReport(sizes=[1] * 16, trained=[100 + j for j in range(16)], iterations=800,
                        per_iteration=8, weighted=True, sampling_steps=17)
    lines = steps.lines()
    assert lines[:2] == ["chunks    16 over steps 0-15 (of 17 sampling steps), sizes",
                         "          1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1"]
    assert lines[2] == ("          8 of 16 chunks per iteration, weighted by dynamics "
                        "(chunks.weighted)")
    counts = " ".join(lines[3:])
    assert all(f"{j}: {100 + j}" in counts for j in range(16)) and len(lines) > 4
    assert all(len(line) <= 80 for line in lines)


def test_the_guard_stop_rule_needs_the_whole_ci_below_minus_the_threshold():
    assert stop_reason("shapes", -0.30, 0.05, 32, 0.1, 50) is not None  # CI -0.35 .. -0.25
    assert stop_reason("shapes", -0.30, 0.25, 32, 0.1, 50) is None  # CI reaches -0.05
    assert stop_reason("shapes", -0.12, 0.01, 32, 0.1, 50) is not None  # all of it below -0.1
    assert stop_reason("shapes", -0.10, 0.01, 32, 0.1, 50) is None  # -0.09 is above -0.1
    assert stop_reason("shapes", -0.30, 0.05, 32, 0.0, 50) is None  # 0: never stops
    assert stop_reason("shapes", -0.30, float("nan"), 1, 0.1, 50) is None  # no CI, no stop
    reason = stop_reason("shapes", -0.30, 0.05, 32, 0.1, 50)
    assert reason == ("guard shapes fell 0.300 below the base's at the evaluation of step 50 (32 "
                      "held-out images, 95% CI of the change -0.350 .. -0.250, all below -0.1: "
                      "eval.guard_stop)")


def test_scoring_the_guard_leaves_the_random_streams_alone():
    class Drawing:  # a guard that draws from every global generator
        def __call__(self, images, prompts):
            random.random()
            np.random.rand()
            return torch.rand(len(prompts))

    guard = Guard("drawing", as_reward_mix(Drawing(), "drawing"))
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    state = (random.getstate(), np.random.get_state()[1].copy())
    scores = guard.score(torch.zeros(2, 3, 4, 4), ["a", "b"])
    assert set(scores) == {"drawing"} and scores["drawing"].shape == (2,)
    torch.testing.assert_close(torch.rand(4), expected)
    assert random.getstate() == state[0] and (np.random.get_state()[1] == state[1]).all()
    metrics = guard.metrics({"drawing": torch.tensor([0.5, float("nan"), 1.0])})
    assert metrics == {"guard/drawing_mean": 0.75,
                       "guard/drawing_std": pytest.approx(0.353553, abs=1e-6)}
