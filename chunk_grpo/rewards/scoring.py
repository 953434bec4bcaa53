"""Scoring rollouts with the run's reward mix: overlapped with sampling, checked before a run.

`RolloutScorer` is `rollout.sample_rollouts`' ``on_batch`` hook: rollout batch i is scored on one
worker thread while the main thread samples batch i+1 (without overlap: every batch after
sampling) (torch releases the GIL inside its
kernels, and a remote reward waits on a socket), so only the last batch's scoring is left once
sampling ends. Scores do not depend on the overlap: each batch is scored whole, in order, by the
same calls. The reward always runs on that (daemon) thread: the main thread only waits, so
Ctrl-C stops a run at once even while a reward blocks, and a call that takes longer than the
``timeout`` is a `RewardTimeoutError`. `probe_reward` calls the rewards once on a small batch
before a run starts; `constant_within_groups` tells a reward that gives a group no learning
signal.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from chunk_grpo.rewards.mix import RewardMix
from chunk_grpo.rewards.outputs import RewardError, RewardOutputError


class RewardTimeoutError(RewardError):
    """A reward call took longer than reward.timeout (it may be stuck)."""


class _DaemonWorker:
    """One daemon thread running submitted calls in order: a call that never returns keeps
    neither the run nor the interpreter's exit waiting (a ThreadPoolExecutor's thread would)."""

    def __init__(self, name: str):
        self.calls: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self.calls.put((future, fn, args))
        return future

    def stop(self) -> None:
        """Cancel what has not started; the thread ends after the running call (if it ever
        returns)."""
        while True:
            try:
                item = self.calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        self.calls.put(None)
        # an idle thread ends at once; one stuck in a call is left behind (it is a daemon)
        self.thread.join(timeout=1.0)

    def _loop(self) -> None:
        while (item := self.calls.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 (handed to the waiting thread)
                future.set_exception(err)


class RolloutScorer:
    """Scores rollout batches as they come on a worker thread (``overlap``), or all after
    sampling; `collect` returns every reward's scores for all rows, in row order. ``timeout``:
    seconds each reward call may take (0: no limit). Use as a context manager."""

    def __init__(self, reward: RewardMix, overlap: bool = True, timeout: float = 0.0):
        self.reward, self.overlap, self.timeout = reward, overlap, timeout
        self.worker = _DaemonWorker("reward")
        self.parts: list[Future | tuple[torch.Tensor, list[str]]] = []
        self.busy_seconds = 0.0  # time spent inside the reward calls

    def _score(self, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        scores = self.reward.score(images.cpu(), prompts)
        self.busy_seconds += time.perf_counter() - start
        return scores

    def _wait(self, future: Future) -> dict[str, torch.Tensor]:
        try:
            return future.result(timeout=self.timeout or None)
        except FutureTimeout:
            names = ", ".join(repr(c.name) for c in self.reward.components)
            raise RewardTimeoutError(
                f"reward {names} did not return within {self.timeout:g} s (reward.timeout): it "
                "may be stuck; check it, or raise reward.timeout") from None

    def score_now(self, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Every reward's scores of ``images`` (counted in busy_seconds), waited for."""
        return self._wait(self.worker.submit(self._score, images, prompts))

    def __call__(self, images: torch.Tensor, prompts: list[str], index: int) -> None:
        if not self.overlap:  # scored in `collect`, after sampling
            self.parts.append((images, prompts))
            return
        for part in self.parts:  # a failed batch stops the rollout now, not after sampling
            if isinstance(part, Future) and part.done() and part.exception() is not None:
                part.result()
        self.parts.append(self.worker.submit(self._score, images, prompts))

    def collect(self) -> dict[str, torch.Tensor]:
        """Every reward's scores [rows], float32 CPU, by label (waits for the worker)."""
        parts = [self._wait(p) if isinstance(p, Future) else self.score_now(*p)
                 for p in self.parts]
        if not parts:
            raise ValueError("no rollout batch was scored")
        return {label: parts[0][label] if len(parts) == 1 else torch.cat([p[label] for p in parts])
                for label in parts[0]}

    def close(self) -> None:
        self.worker.stop()

    def __enter__(self) -> RolloutScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def probe_reward(reward: RewardMix, height: int, width: int, prompts: list[str],
                 n: int = 2) -> dict[str, torch.Tensor]:
    """Score ``n`` fixed random images of the model's size with the first training prompts,
    so that a reward that fails or returns the wrong thing stops the run before it starts.
    Draws from its own generator: the run's random streams are untouched."""
    if not prompts:
        raise ValueError("probe_reward needs at least one prompt")
    images = torch.rand(n, 3, height, width, generator=torch.Generator().manual_seed(0))
    probe_prompts = [prompts[i % len(prompts)] for i in range(n)]
    try:
        scores = reward.score(images, probe_prompts)
    except RewardError as err:
        raise type(err)(f"checking the reward before training ({n} images of {height}x{width}): "
                        f"{err}") from err
    for label, values in scores.items():
        if not bool(torch.isfinite(values).all()):
            raise RewardOutputError(
                f"checking the reward before training ({n} images of {height}x{width}): "
                f"reward {label!r} returned NaN/Inf scores {values.tolist()}; a run would skip "
                "every iteration it does so and train nothing: fix the reward")
    return scores


def constant_within_groups(rewards: torch.Tensor, group_size: int) -> bool:
    """Whether every group of ``group_size`` consecutive rewards is constant (zero advantage
    for every image, whatever the normalisation)."""
    r = rewards.view(-1, group_size)
    return bool((r.amax(dim=1) == r.amin(dim=1)).all())
