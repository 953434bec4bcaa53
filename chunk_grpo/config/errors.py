"""The errors every command reports in one line: importable by any module, imports nothing."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it and the fix."""


class RunInterrupted(RuntimeError):
    """Ctrl-C (or SIGTERM) stopped a run; the message names the checkpoint to resume from.
    ``status``: the exit status, the shell's 128 + the signal number."""

    def __init__(self, message: str, status: int = 130):
        super().__init__(message)
        self.status = status


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread where Ctrl-C's KeyboardInterrupt would be."""


def interruption(err: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped a command, as said in its message, and its exit status."""
    return ("SIGTERM", 143) if isinstance(err, Terminated) else ("Ctrl-C", 130)


# The trainer's own: defined here, not in train.py, which `python -m chunk_grpo.train` runs as
# __main__, where the command runner would not find them.
class TrainingDiverged(RuntimeError):
    """Too many consecutive iterations with NaN/Inf rewards, losses or gradients."""


class NothingTrained(RuntimeError):
    """A run ended without a single optimizer step; the message says why."""
