"""What the training progress bar shows: where the run will stop and how long that takes.

A run stops at ``run.max_steps`` or once ``run.max_minutes`` of training have passed, whichever
comes first (the iteration under way when the time runs out finishes). `training_progress`
turns the measured time per iteration into the step the run is expected to stop at (the bar's
total) and the training time left (its ETA); `progress_postfix` is the text beside the bar. Both
are pure: the loop passes in the clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tqdm import tqdm

# tqdm's default without its own "<remaining" (the rate of the last iterations times max_steps):
# the ETA is ours, in the postfix.
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"


@dataclass(frozen=True)
class Progress:
    """The bar's total and ETA after some iterations."""

    total: int | None  # the step the run is expected to stop at (None: not known yet)
    by_time: bool  # the time budget, not max_steps, is expected to end the run
    eta_seconds: float | None  # training seconds left (None: not known yet)


def training_progress(*, start: int, step: int, max_steps: int, max_minutes: float,
                      elapsed: float) -> Progress:
    """Where a run that began this invocation at step ``start`` and is now at ``step`` (after
    ``elapsed`` seconds of training, evaluations and checkpoints included) is expected to stop.

    Without a time budget (``max_minutes`` 0) it stops at ``max_steps``. With one, the loop
    checks the clock after each iteration and stops once the budget is exceeded, so at the mean
    seconds per iteration s it runs floor((budget - elapsed) / s) + 1 more iterations (at least
    one), or up to ``max_steps`` if that comes first. The ETA is those iterations at s. Before
    the first iteration nothing is measured: with a time budget, total and ETA are unknown."""
    done = step - start
    if done <= 0:
        return Progress(None if max_minutes > 0 else max_steps, False, None)
    per_iteration = elapsed / done
    total = max_steps
    if max_minutes > 0 and per_iteration > 0:
        left = max(0.0, 60 * max_minutes - elapsed)
        total = min(max_steps, step + math.floor(left / per_iteration) + 1)
    return Progress(total, total < max_steps, (total - step) * per_iteration)


def progress_postfix(progress: Progress, *, max_steps: int, max_minutes: float,
                     reward: float | None = None) -> str:
    """The text beside the bar: the last reward, what ends the run and the training time left,
    e.g. ``reward=-1.234, stop=10 min (before 400 steps), left=05:53``."""
    if progress.by_time:
        stop = f"{max_minutes:g} min (before {max_steps} steps)"
    elif progress.total is None:
        stop = f"{max_steps} steps or {max_minutes:g} min"
    else:
        stop = f"{max_steps} steps"
    left = "?" if progress.eta_seconds is None else tqdm.format_interval(progress.eta_seconds)
    parts = [] if reward is None else [f"reward={reward:.3f}"]
    return ", ".join([*parts, f"stop={stop}", f"left={left}"])
