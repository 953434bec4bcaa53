"""The progress bar's total and ETA: the step the run will stop at, by max_steps or by the time
budget, and the training time left (pure arithmetic on a given clock)."""

import pytest

from chunk_grpo.train.progress import Progress, progress_postfix, training_progress


def at(step: int, elapsed: float, *, start: int = 0, max_steps: int = 400,
       max_minutes: float = 10.0) -> Progress:
    return training_progress(start=start, step=step, max_steps=max_steps,
                             max_minutes=max_minutes, elapsed=elapsed)


def test_the_time_budget_sets_the_total_when_it_binds_first():
    # 10 iterations in 100 s (10 s each), 500 s of the 600 s budget left: the loop checks the
    # clock after each iteration and stops once past 600 s, so 50 more finish at 600 s (not
    # past it) and the 51st ends the run at 610 s: step 61, 510 s from now.
    p = at(10, 100.0)
    assert p == Progress(total=61, by_time=True, eta_seconds=pytest.approx(510.0))
    # the budget just spent: one more iteration, the one under way when the time runs out
    assert at(60, 600.0) == Progress(61, True, pytest.approx(10.0))
    assert at(61, 610.0) == Progress(62, True, pytest.approx(10.0))  # past it: at most one more


def test_max_steps_sets_the_total_when_it_comes_first_and_the_eta_is_its_time():
    p = at(10, 100.0, max_steps=40)  # 30 more iterations take 300 s, within the budget
    assert p == Progress(total=40, by_time=False, eta_seconds=pytest.approx(300.0))
    unlimited = at(10, 100.0, max_minutes=0)  # no budget: max_steps at the measured rate
    assert unlimited == Progress(total=400, by_time=False, eta_seconds=pytest.approx(3900.0))


def test_a_resumed_run_measures_only_its_own_iterations():
    # resumed at step 100 with a fresh 10-minute budget: 5 iterations in 60 s (12 s each)
    p = at(105, 60.0, start=100)
    assert p == Progress(total=105 + 45 + 1, by_time=True, eta_seconds=pytest.approx(552.0))


def test_before_the_first_iteration_nothing_is_known():
    assert at(0, 0.0) == Progress(total=None, by_time=False, eta_seconds=None)
    assert at(7, 0.0, start=7, max_minutes=0) == Progress(400, False, None)


def test_the_postfix_names_what_ends_the_run_and_the_time_left():
    assert progress_postfix(at(10, 100.0), max_steps=400, max_minutes=10, reward=-1.23456) == (
        "reward=-1.235, stop=10 min (before 400 steps), left=08:30")
    assert progress_postfix(at(10, 100.0, max_steps=40), max_steps=40, max_minutes=10) == (
        "stop=40 steps, left=05:00")
    assert progress_postfix(at(0, 0.0), max_steps=400, max_minutes=10) == (
        "stop=400 steps or 10 min, left=?")
    assert progress_postfix(at(1, 3600.0, max_steps=3, max_minutes=0), max_steps=3,
                            max_minutes=0) == "stop=3 steps, left=2:00:00"
