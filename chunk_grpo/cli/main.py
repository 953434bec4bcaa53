"""`chunk-grpo`: one command for every job, ``chunk-grpo <command> [flags]``.

Each command is a module of `chunk_grpo.cli` whose ``main(argv, prog)`` checks the command's
flags before it imports torch; ``python -m chunk_grpo.<module>`` runs the same command (a shim
or a subpackage's ``__main__.py`` calls `run`). Nothing heavy is imported here, so
``chunk-grpo --help`` and ``chunk-grpo <command> --help`` answer at once.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from dataclasses import dataclass

from chunk_grpo.cli.runner import _loaded_one_line_errors, run_command
from chunk_grpo.runtime.quiet import quiet_third_party


@dataclass(frozen=True)
class Command:
    module: str  # chunk_grpo.cli.<module>, also run as `python -m chunk_grpo.<module>`
    summary: str
    one_line_errors: bool = True  # False: the command reports its errors and status itself


COMMANDS: dict[str, Command] = {
    "train": Command("train", "fine-tune a model with Chunk-GRPO (or G2RPO)"),
    "evaluate": Command("evaluate", "sample a prompt set, score it, the mean with its 95% CI"),
    "plan": Command("plan", "the memory plan of a training config, before any GPU is touched"),
    "cache-prompts": Command("cache_prompts", "fill the prompt-embedding cache of a run"),
    "profile": Command("profile", "the temporal-dynamics profile of a model, and chunks from it"),
    "gradient-snr": Command(
        "gradient_snr", "the policy-gradient signal-to-noise ratio of a config"),
    "ablate": Command("ablate", "the chunk ablation (the paper's Table 3) at toy scale"),
    "credit": Command("credit", "where the reward is decided: the reward spread step by step"),
    "pretrain": Command("pretrain", "pretrain the embedded tiny FLUX on the shapes world"),
    "pretrain-clip": Command("pretrain_clip", "pretrain a tiny CLIP on the shapes world"),
    "evaluate-clip": Command("evaluate_clip", "how good a shapes-world CLIP is as a reward"),
    "reward-server": Command("reward_server", "serve a reward over HTTP", one_line_errors=False),
    "gpu-check": Command(
        "gpu_check", "the acceptance check of a machine with a CUDA GPU", one_line_errors=False),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: chunk-grpo <command> [flags]    (chunk-grpo <command> --help: its flags)",
             "", "Chunk-GRPO for flow-matching text-to-image models.", "", "commands:"]
    lines += [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    return "\n".join(lines) + "\n"


def run(name: str, argv: list[str] | None = None, prog: str | None = None) -> None:
    """Run command ``name`` as its process's entry point: third-party output quiet unless
    ``--verbose``; a bad flag or config, or an error the command knows, is one line on stderr
    and exit status 2; Ctrl-C exits 130 and SIGTERM 143 (`run_command`)."""
    command = COMMANDS[name]
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = prog or f"python -m chunk_grpo.{command.module}"
    quiet_third_party("--verbose" in argv)
    module = importlib.import_module(f"chunk_grpo.cli.{command.module}")
    if not command.one_line_errors:
        raise SystemExit(module.main(argv, prog=prog))
    run_command(lambda: module.main(argv, prog=prog), prog, errors=_loaded_one_line_errors)


def main(argv: list[str] | None = None) -> None:
    """The ``chunk-grpo`` console script: ``chunk-grpo <command> [flags]``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        (sys.stdout if argv else sys.stderr).write(usage())
        raise SystemExit(0 if argv else 2)
    name = argv[0].replace("_", "-")  # the module's spelling works too: gradient_snr
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        sys.stderr.write(f"chunk-grpo: error: unknown command {argv[0]!r}{hint} "
                         "(see chunk-grpo --help)\n")
        raise SystemExit(2)
    run(name, argv[1:], prog=f"chunk-grpo {name}")
