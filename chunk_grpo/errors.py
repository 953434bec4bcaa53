"""The errors every command reports in one line: importable by any module, imports nothing."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it and the fix."""


class RunInterrupted(RuntimeError):
    """Ctrl-C stopped a run; the message names the checkpoint to resume from."""
