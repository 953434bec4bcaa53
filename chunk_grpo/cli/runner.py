"""The commands' runner: a known error is one line on stderr and exit status 2, Ctrl-C is 130,
SIGTERM (handled like Ctrl-C) 143.

Every command runs under `run_command` (`chunk_grpo.cli.main.run`: ``chunk-grpo <command>`` and
``python -m chunk_grpo.<command>``).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

from chunk_grpo.config.errors import ConfigError, RunInterrupted, Terminated, interruption
from chunk_grpo.runtime.quiet import quiet_third_party


def run_command(main: Callable[[], object], prog: str,
                errors: tuple[type[Exception], ...] | Callable[[], tuple] = ()) -> None:
    """Run a command-line entry point: a ConfigError (or one of ``errors``, e.g. a model that
    cannot be loaded) prints one line and exits with status 2, as argparse does for bad flags,
    instead of a traceback (its message already says the fix). Ctrl-C prints one line and exits
    with status 130, the shell's convention for SIGINT; SIGTERM the same way with 143. ``errors``
    may be a function returning the classes, imported only when an error happens (they live in
    heavy modules)."""
    previous = _handle_sigterm()
    try:
        main()
    except (KeyboardInterrupt, RunInterrupted) as err:
        if isinstance(err, RunInterrupted):
            why, status = _one_line(err), err.status
        else:
            what, status = interruption(err)
            why = f"interrupted ({what})"
        sys.stderr.write(f"{prog}: {why}\n")
        raise SystemExit(status) from None
    except Exception as err:
        kinds = errors() if callable(errors) else errors
        if not isinstance(err, (ConfigError, *kinds)):
            raise
        sys.stderr.write(f"{prog}: error: {_one_line(err)}\n")
        raise SystemExit(2) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_terminated(signum, frame) -> None:
    raise Terminated


def _handle_sigterm():
    """SIGTERM raises `Terminated` (a KeyboardInterrupt) in the main thread, so a run stops as
    on Ctrl-C: one line naming the checkpoint to resume from."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


def _one_line(err: BaseException) -> str:
    """The error's message on one line (some messages carry a hint on a second line)."""
    return " ".join(str(err).split("\n"))


def run_cli(main: Callable[[], object], module: str) -> None:
    """The ``__main__`` of ``python -m module``: `run_command` with every error a command reports
    in one line (a bad configuration or input file, a model or reward that cannot be loaded, an
    unknown reward, a bad reward spec or output, a damaged checkpoint, a locked run directory,
    a full disk, a run that diverged or trained nothing)."""
    quiet_third_party("--verbose" in sys.argv[1:])

    run_command(main, f"python -m {module}", errors=_loaded_one_line_errors)


# Errors reported in one line besides ConfigError, by module: looked up only among the modules
# already imported (an error can only come from a loaded module), so that reporting a bad flag
# never imports diffusers.
_ONE_LINE_ERRORS = (
    ("chunk_grpo.models.loading", "ModelLoadError"),
    ("chunk_grpo.rewards.registry", "UnknownRewardError"),
    ("chunk_grpo.rewards.registry", "RewardLoadError"),
    ("chunk_grpo.config.reward_spec", "RewardSpecError"),
    ("chunk_grpo.rewards.outputs", "RewardError"),
    ("chunk_grpo.train.checkpoint", "CheckpointError"),
    ("chunk_grpo.train.checkpoint", "DiskFullError"),
    ("chunk_grpo.runtime.parallelize", "ParallelismError"),
    ("chunk_grpo.train.run_lock", "RunLockedError"),
    ("chunk_grpo.config.errors", "TrainingDiverged"),
    ("chunk_grpo.config.errors", "NothingTrained"),
)


def _loaded_one_line_errors() -> tuple[type[Exception], ...]:
    return tuple(getattr(sys.modules[module], name) for module, name in _ONE_LINE_ERRORS
                 if module in sys.modules)
