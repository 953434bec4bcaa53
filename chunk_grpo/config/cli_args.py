"""The commands' argparse machinery, importable without torch: one-line errors, values that start
with a dash, the value types, and the checks every command shares.

Every parser built on `OneLineArgumentParser` answers a bad flag in one line (``prog: error:
...``, exit status 2) and takes values that start with a dash (``--chunks -1,4`` reaches the
config check instead of argparse's "expected one argument"). Each command's own flags are in its
module of `chunk_grpo.cli`, which parses them before it imports torch and diffusers: ``--help``
and a misspelt flag answer in well under 2 s.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from chunk_grpo.config.errors import ConfigError

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny-flux-shapes"


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors and dash-leading option values."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(2)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(attach_dash_values(self, args), namespace)


def attach_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--flag -1,4`` -> ``--flag=-1,4`` for flags that take one value: argparse reads a
    dash-leading word (other than a plain negative number) as the next flag."""
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        action = parser._option_string_actions.get(word)
        takes_value = action is not None and action.nargs is None and action.const is None \
            and not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                        argparse._HelpAction, argparse._CountAction))
        if (takes_value and i + 1 < len(argv) and argv[i + 1].startswith("-")
                and argv[i + 1] != "--" and argv[i + 1] not in parser._option_string_actions):
            out.append(f"{word}={argv[i + 1]}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


# ----------------------------------------------------------------------------- value types

def _number(kind: type, text: str) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``low``."""

    def parse(text: str) -> int:
        value = _number(int, text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
at_least_two = int_at_least(2)


def finite_float(text: str) -> float:
    return _number(float, text)


def positive_float(text: str) -> float:
    value = _number(float, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def nonnegative_float(text: str) -> float:
    value = _number(float, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true",
                        help="show third-party warnings and progress bars (hidden by default)")


def model_path(name: str) -> str:
    """``model.name`` as a directory or hub id: "embedded" is the tiny FLUX in the package."""
    return str(EMBEDDED_MODEL_DIR) if name == "embedded" else name


def resolve_device(name: str, key: str = "run.device"):
    """``run.device`` as a torch.device: auto is cuda when one is available, else cpu. Imports
    torch: call it once the flags are checked."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    elif name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key} cuda: no CUDA device is available here; give --{key} cpu "
                          "(or auto)")
    return torch.device(name)


# ----------------------------------------------------------------------------- parsers

def check_writable_dir(path: str | Path, what: str) -> None:
    """Raise ConfigError unless ``path`` is, or can be created as, a writable directory; checked
    before a command's work so that its results have somewhere to go."""
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{what} {path}: {probe} is a file, not a directory; choose another path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path}: {probe} is not writable (permission denied); choose a "
                         "writable directory")
