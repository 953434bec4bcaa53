"""The commands' argument parsers, importable without torch, and the checks every command shares.

Every parser here answers a bad flag in one line (``prog: error: ...``, exit status 2) and takes
values that start with a dash (``--chunks -1,4`` reaches the config check instead of argparse's
"expected one argument"). `check_command_line_early` runs them from the package's ``__init__``
when a command starts (``python -m chunk_grpo.<command>``), before the command imports torch and
diffusers: ``--help`` and a misspelt flag answer in well under 2 s. Every command starts quiet
(`chunk_grpo.quiet`) unless ``--verbose`` is given.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from chunk_grpo.errors import ConfigError
from chunk_grpo.quiet import quiet_third_party
from chunk_grpo.sampling_options import SAMPLERS, SDE_KINDS

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "tiny-flux-shapes"


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


def add_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--height", type=positive_int, default=None,
                        help="image height (default: the model's chunk_grpo.json)")
    parser.add_argument("--width", type=positive_int, default=None,
                        help="image width (default: the model's chunk_grpo.json)")


# ----------------------------------------------------------------------------- parsers

def evaluate_parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(
        prog="python -m chunk_grpo.evaluate", allow_abbrev=False,
        description="Sample images for a prompt set and score them with a reward.")
    p.add_argument("--model", default=str(EMBEDDED_MODEL_DIR), help="diffusers FLUX dir or hub id")
    p.add_argument("--prompts", default="shapes:heldout",
                   help="prompt set: .txt/.jsonl/.csv file, datasets DIR[::SPLIT], "
                        "hf:NAME:SPLIT or shapes:heldout")
    p.add_argument("--out", default="runs/evaluate", help="output directory")
    p.add_argument("--reward", default="shapes")
    p.add_argument("--steps", type=at_least_two, default=None,
                   help="sampling steps (model default)")
    p.add_argument("--shift", type=positive_float, default=None, help="sigma shift (model default)")
    p.add_argument("--sampler", default="ode", choices=SAMPLERS)
    p.add_argument("--eta", type=nonnegative_float, default=0.0,
                   help="noise level of an SDE sampler")
    p.add_argument("--cfg-scale", type=nonnegative_float, default=None,
                   help="CFG scale (model default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--images-per-prompt", type=positive_int, default=1)
    p.add_argument("--max-prompts", type=positive_int, default=None,
                   help="use the first N prompts")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--hybrid-base", default=None, help="base model for the last steps")
    p.add_argument("--hybrid-steps", type=nonnegative_int, default=0,
                   help="first K steps use --model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--compare", default=None, metavar="EVAL_DIR",
                   help="an earlier evaluation's --out (same prompts and seed): report the "
                        "paired per-image reward difference with its 95%% CI")
    add_size(p)
    add_verbose(p)
    return p


def credit_parser(description: str | None = None) -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog="python -m chunk_grpo.credit", description=description,
                              allow_abbrev=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(EMBEDDED_MODEL_DIR))
    p.add_argument("--reward", default="shapes")
    p.add_argument("--prompts-file", default="shapes:rl", help="prompt set (as --train-prompts)")
    p.add_argument("--prompts", type=positive_int, default=8, help="number of prompts")
    p.add_argument("--group-size", type=at_least_two, default=8)
    p.add_argument("--num-steps", type=at_least_two, default=10)
    p.add_argument("--shift", type=positive_float, default=3.0)
    p.add_argument("--kind", default="flow", choices=SDE_KINDS)
    p.add_argument("--eta", type=positive_float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="credit")
    add_size(p)
    add_verbose(p)
    return p


def profile_parser(description: str | None = None) -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog="python -m chunk_grpo.profile", description=description,
                              allow_abbrev=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(EMBEDDED_MODEL_DIR))
    p.add_argument("--prompts-file", default="shapes:train", help="prompt set (as --train-prompts)")
    p.add_argument("--prompts", type=positive_int, default=16, help="number of prompts")
    p.add_argument("--num-steps", type=at_least_two, default=None)
    p.add_argument("--shift", type=positive_float, default=None)
    p.add_argument("--max-chunk-size", type=positive_int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="profile")
    add_size(p)
    add_verbose(p)
    return p


def gradient_snr_parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(
        prog="python -m chunk_grpo.gradient_snr", allow_abbrev=False,
        description="Policy-gradient signal-to-noise ratio of a training config: K independent "
                    "iterations at the same weights. Other flags are those of chunk_grpo.train.")
    p.add_argument("--iterations", type=int, default=16,
                   help="independent iterations K (>= 3; default 16)")
    p.add_argument("--first-step", type=nonnegative_int, default=0,
                   help="iteration index of the first one (selects prompts and noise)")
    p.add_argument("--per-chunk", action="store_true",
                   help="also measure each chunk's own gradient (trains every chunk)")
    p.add_argument("--json", metavar="FILE", help="also write the statistics here")
    return p


def pretrain_parser(description: str | None = None) -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog="python -m chunk_grpo.pretrain", description=description,
                              allow_abbrev=False, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output diffusers directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-images", type=positive_int, default=20000,
                   help="rendered training scenes")
    p.add_argument("--vae-steps", type=positive_int, default=400)
    p.add_argument("--vae-batch-size", type=positive_int, default=16)
    p.add_argument("--vae-lr", type=positive_float, default=1e-3)
    p.add_argument("--steps", type=positive_int, default=1500, help="transformer optimizer steps")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--warmup-steps", type=nonnegative_int, default=100)
    p.add_argument("--ema-decay", type=nonnegative_float, default=0.995)
    p.add_argument("--caption-dropout", type=nonnegative_float, default=0.1)
    p.add_argument("--shift", type=positive_float, default=3.0,
                   help="sigma shift (training and sampling)")
    p.add_argument("--cfg-scale", type=nonnegative_float, default=3.0,
                   help="recorded default CFG scale")
    p.add_argument("--checkpoint-every", type=nonnegative_int, default=0,
                   help="also save every k steps")
    p.add_argument("--threads", type=positive_int, default=2)
    add_verbose(p)
    return p


def plan_parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(
        prog="python -m chunk_grpo.plan", allow_abbrev=False,
        description="Memory plan of a training config: the peak of every phase (load, prompt "
                    "caching, profile, rollout, reward, training, evaluation, checkpoint, export) "
                    "per GPU and per host, from its parts (weights, gradients, optimizer state, "
                    "activations measured with FakeTensor, frozen models, reward), and whether "
                    "it fits. Other flags are those of "
                    "chunk_grpo.train (--config, --model, --lora-rank, ...).")
    p.add_argument("--gpus", type=positive_int, default=1, help="GPUs (world size; default 1)")
    p.add_argument("--gpu-memory", type=positive_float, default=80.0, metavar="GB",
                   help="memory per GPU in GB (default 80)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None, metavar="N",
                   help="GPUs per host, for the host memory per node (default min(gpus, 8))")
    p.add_argument("--reward-gb", type=nonnegative_float, default=None, metavar="GB",
                   help="the reward model's weights in GB, for a reward the plan does not know")
    p.add_argument("--json", metavar="FILE", help="also write the numbers here")
    return p


def _parse_plan(argv: list[str]) -> None:
    _, rest = plan_parser().parse_known_args(argv)
    _parse_train(rest, prog="python -m chunk_grpo.plan")


def _parse_train(argv: list[str], prog: str = "python -m chunk_grpo.train") -> None:
    """The flags, then the configuration they build (a resumed run's needs its directory)."""
    from chunk_grpo.config import build_config, parse_args

    yaml_path, overrides, resume = parse_args(argv, prog=prog)
    if not resume:
        build_config(yaml_path, overrides)


def _parse_gradient_snr(argv: list[str]) -> None:
    _, rest = gradient_snr_parser().parse_known_args(argv)
    _parse_train(rest, prog="python -m chunk_grpo.gradient_snr")


EARLY_PARSERS: dict[str, Callable[[list[str]], object]] = {
    "chunk_grpo.train": _parse_train,
    "chunk_grpo.gradient_snr": _parse_gradient_snr,
    "chunk_grpo.plan": _parse_plan,
    "chunk_grpo.cache_prompts": lambda argv: _parse_train(
        argv, prog="python -m chunk_grpo.cache_prompts"),
    "chunk_grpo.evaluate": lambda argv: evaluate_parser().parse_args(argv),
    "chunk_grpo.credit": lambda argv: credit_parser().parse_args(argv),
    "chunk_grpo.profile": lambda argv: profile_parser().parse_args(argv),
    "chunk_grpo.pretrain": lambda argv: pretrain_parser().parse_args(argv),
}


def started_command() -> str | None:
    """The ``chunk_grpo.<command>`` this interpreter was started with (``python -m``), if any.
    Only meaningful while the package is being imported for ``-m``."""
    if sys.argv[:1] != ["-m"]:
        return None
    orig = getattr(sys, "orig_argv", [])
    if "-m" not in orig or orig.index("-m") + 1 >= len(orig):
        return None
    return orig[orig.index("-m") + 1]


def check_command_line_early() -> None:
    """Parse a starting command's flags before its heavy imports: ``--help`` and bad flags
    exit here, in a fraction of a second. A valid command line continues (and is parsed again
    by the command itself)."""
    command = started_command()
    if command is None or not command.startswith("chunk_grpo."):
        return
    argv = sys.argv[1:]
    # before the command's imports: some packages speak while being imported (chunk_grpo.quiet)
    quiet_third_party("--verbose" in argv)
    if command not in EARLY_PARSERS:
        return
    from chunk_grpo.config import ConfigError

    try:
        EARLY_PARSERS[command](argv)
    except ConfigError as err:
        sys.stderr.write(f"python -m {command}: error: {err}\n")
        raise SystemExit(2) from None


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
