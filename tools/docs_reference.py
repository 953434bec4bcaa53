"""Write the generated reference pages from the code.

    python tools/docs_reference.py           # rewrite docs/reference/config.md and cli.md
    python tools/docs_reference.py --check   # exit 1, naming the stale files, if either differs

``config.md`` comes from the `TrainConfig` section dataclasses (every key with its type or
choices, its default, and the comment beside the field); ``cli.md`` from the argument parser of
every command, the one its ``--help`` prints. ``tests/unit/test_docs.py`` regenerates both in memory
and compares them with the files, so a changed flag or default fails the tests until this
script has been run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import io
import os
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the repository's package
    sys.path.insert(0, str(ROOT))

CONFIG_PAGE = "docs/reference/config.md"
CLI_PAGE = "docs/reference/cli.md"
REGENERATE = "python tools/docs_reference.py"

# (command, module, one line on what it is for): the order of cli.md.
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("train", "chunk_grpo.cli.train", "Chunk-GRPO or G2RPO training"),
    ("evaluate", "chunk_grpo.cli.evaluate",
     "sample a prompt set, score it, compare two evaluations"),
    ("plan", "chunk_grpo.cli.plan", "the memory plan of a training config"),
    ("cache_prompts", "chunk_grpo.cli.cache_prompts",
     "encode a run's prompts once, into the cache"),
    ("reward_server", "chunk_grpo.cli.reward_server", "serve a reward over HTTP"),
    ("profile", "chunk_grpo.cli.profile", "the temporal-dynamics curve and its proposed chunks"),
    ("credit", "chunk_grpo.cli.credit", "where the reward is decided, step by step"),
    ("gradient_snr", "chunk_grpo.cli.gradient_snr", "the policy gradient's signal-to-noise ratio"),
    ("ablate", "chunk_grpo.cli.ablate", "the chunk ablation at toy scale"),
    ("pretrain", "chunk_grpo.cli.pretrain", "rebuild the embedded tiny FLUX"),
    ("pretrain_clip", "chunk_grpo.cli.pretrain_clip", "rebuild the shapes-clip reward model"),
    ("evaluate_clip", "chunk_grpo.cli.evaluate_clip", "measure a shapes-world CLIP as a reward"),
    ("gpu_check", "chunk_grpo.cli.gpu_check", "the acceptance check of a CUDA machine"),
)

# argparse wraps to the terminal's width; the pages must not depend on it.
_COLUMNS = "100"


# ----------------------------------------------------------------------------- config.md

def _cell(text: str) -> str:
    """Text for a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def resume_classes() -> dict[str, str]:
    """{dotted key: what a resumed run does with it}, from `chunk_grpo.train.run_checkpoint`."""
    from chunk_grpo.train import run_checkpoint as tc

    groups = (("fixed", "FIXED_ON_RESUME"), ("per-rank", "PER_RANK_ON_RESUME"),
              ("optimizer", "OPTIMIZER_ON_RESUME"), ("applied", "APPLIED_ON_RESUME"))
    return {path: label for label, name in groups for path in getattr(tc, name, ())}


def config_reference() -> str:
    """docs/reference/config.md."""
    from chunk_grpo.config import schema as config
    from chunk_grpo.config.checks import literal_choices
    from chunk_grpo.config.describe import field_comments, type_name, yaml_value

    on_resume = resume_classes()
    defaults = config.TrainConfig()
    out = [
        "# Configuration reference",
        "",
        f"Generated from `chunk_grpo/config/schema.py` by `{REGENERATE}`; do not edit by hand.",
        "",
        "Every key is `section.key`: a flag `--section.key VALUE` of `train` (and of `plan`,",
        "`cache_prompts`, `gradient_snr`, `ablate`, `credit`, `profile`), a nested or dotted key",
        "in a YAML file given with `--config`. Precedence: these defaults, then the YAML file,",
        "then the flags. `evaluate`, `evaluate_clip` and `reward_server` take the keys they use",
        "under the same names, with defaults of their own ([commands](cli.md)).",
        "`configs/default.yaml` spells out every default. How to write a config:",
        "[the configuration guide](../guides/configuration.md).",
        "",
        "On resume (`--resume RUN`): *fixed* keys cannot change; *per-rank* keys are recomputed",
        "for a new world size; *optimizer* keys are written into the restored optimizer,",
        "schedule and EMA; *applied* keys simply take the new value",
        "([checkpoints](../guides/checkpoints.md)).",
        "",
    ]
    for section, cls in config.SECTIONS.items():
        hints = typing.get_type_hints(cls)
        notes = field_comments(cls)
        out += [f"## {section}", "", (cls.__doc__ or "").strip(), ""]
        out += ["| key | type | default | on resume | description |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            path = f"{section}.{f.name}"
            choices = literal_choices(hints[f.name])
            kind = (" \\| ".join(f"`{c}`" for c in choices) if choices
                    else type_name(hints[f.name]))
            out.append(f"| `{path}` | {kind} | `{_cell(yaml_value(defaults.get(path)))}` | "
                       f"{on_resume.get(path, '')} | {_cell(notes.get(f.name, ''))} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


# ----------------------------------------------------------------------------- cli.md

class _Captured(Exception):  # noqa: N818 (a signal, not an error)
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def command_parser(module: str) -> argparse.ArgumentParser:
    """The parser that answers ``python -m <module> --help``: the command's ``main`` is run
    with ``--help``, and the parser is taken where it would print."""
    main = importlib.import_module(module).main

    def capture(self, file=None):
        raise _Captured(self)

    original = argparse.ArgumentParser.print_help
    argparse.ArgumentParser.print_help = capture
    try:
        main(["--help"])
    except _Captured as captured:
        return captured.parser
    finally:
        argparse.ArgumentParser.print_help = original
    raise RuntimeError(f"{module}.main(['--help']) returned without printing its help")


def _relative(value: Any) -> Any:
    """A default inside this repository, as a path relative to its root."""
    text = str(value)
    prefix = str(ROOT) + os.sep
    return text.replace(prefix, "") if prefix in text else value


def _expand_help(action: argparse.Action, prog: str) -> str:
    """The help text with its %(...)s filled in, as argparse prints it."""
    params = dict(vars(action), prog=prog)
    params = {k: v for k, v in params.items() if v is not argparse.SUPPRESS}
    params = {k: getattr(v, "__name__", v) for k, v in params.items()}
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    return (action.help or "") % params


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "(switch)"
    if action.choices is not None:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    return f"`{action.metavar or action.dest.upper()}`"


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
        return ""
    if action.default == "":
        return '`""`'
    return f"`{_cell(str(_relative(action.default)))}`"


def _usage(parser: argparse.ArgumentParser) -> str:
    if parser.usage:
        return parser.usage % {"prog": parser.prog}
    required = [f"{a.option_strings[0]} {a.metavar or a.dest.upper()}" for a in parser._actions
                if a.required and a.option_strings]
    return " ".join([parser.prog, *required, "[options]"])


def _describe(parser: argparse.ArgumentParser) -> list[str]:
    text = inspect.cleandoc(parser.description or "")
    if not text:
        return []
    raw = (argparse.RawDescriptionHelpFormatter, argparse.RawTextHelpFormatter)
    if not isinstance(parser._get_formatter(), raw):  # argparse refills the text
        text = textwrap.fill(" ".join(text.split()), width=int(_COLUMNS) - 2)
    return ["```text", text.replace(str(ROOT) + os.sep, ""), "```", ""]


class _Dotted:
    """A config's values by dotted key."""

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def get(self, path: str) -> Any:
        section, _, key = path.partition(".")
        return getattr(getattr(self.cfg, section), key)


def command_reference(name: str, module: str, summary: str) -> list[str]:
    from chunk_grpo.config.checks import section_names
    from chunk_grpo.config.describe import yaml_value
    from chunk_grpo.config.schema import SECTIONS, TrainConfig

    parser = command_parser(module)
    out = [f"## {name}", "", f"{summary[0].upper()}{summary[1:]}.", "",
           f"    {_usage(parser)}", ""]
    out += _describe(parser)
    sections = False
    # A command on the training config: its keys are config.md's. A command config of its own
    # (chunk_grpo.config.commands): its sections are listed here, each under its name.
    train_keys = getattr(parser, "config_class", None) is TrainConfig
    own_sections = section_names(parser.config_class) if hasattr(parser, "config_class") else {}
    parser_keys = getattr(parser, "config_dests", set())
    defaults = _Dotted(parser.config_class()) if own_sections else None
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if group.title in SECTIONS and train_keys:
            sections = True
            continue
        if not actions:
            continue
        if group.title in own_sections:
            out += [f"`{group.title}`: {inspect.cleandoc(group.description or '')}", ""]
        out += ["| flag | value | default | what it does |", "|---|---|---|---|"]
        for a in actions:
            value, default, text = _value(a), _default(a), _expand_help(a, parser.prog)
            if a.dest in parser_keys:  # a key: its default in the column, not in the text
                text = text.rpartition("default ")[0].rstrip("; ")
                default = f"`{_cell(yaml_value(defaults.get(a.dest)))}`"
            out.append(f"| `{', '.join(a.option_strings) or a.dest}` | {_cell(value)} | "
                       f"{default} | {_cell(text)} |")
        out.append("")
    if sections:
        out += ["Every configuration key is also a flag, `--section.key VALUE`: see",
                "[the configuration reference](config.md).", ""]
    elif "Other flags are those of chunk_grpo.train" in (parser.description or ""):
        out += ["The flags of [`train`](#train) set the configuration it measures or runs.", ""]
    return out


def cli_reference() -> str:
    """docs/reference/cli.md."""
    out = [
        "# Command reference",
        "",
        f"Generated from the commands' argument parsers by `{REGENERATE}`; do not edit by",
        "hand. Each command is `python -m chunk_grpo.<command>`; `--help` prints the same.",
        "A bad flag or value is one line on stderr naming it and the fix, exit status 2.",
        "",
    ]
    out += [f"- [`{name}`](#{name}): {summary}" for name, _, summary in COMMANDS]
    out.append("")
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = _COLUMNS
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            for name, module, summary in COMMANDS:
                out += command_reference(name, module, summary)
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous
    return "\n".join(out).rstrip() + "\n"


# ----------------------------------------------------------------------------- both

def pages() -> dict[str, str]:
    """{path relative to the repository: its generated text}."""
    return {CONFIG_PAGE: config_reference(), CLI_PAGE: cli_reference()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a page differs from the code")
    args = parser.parse_args(argv)
    from chunk_grpo.runtime.quiet import quiet_third_party

    quiet_third_party(False)  # the commands' imports, as a command starts: no library chatter
    stale = []
    for rel, text in pages().items():
        path = ROOT / rel
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(rel)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run `{REGENERATE}`", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(stale)}" if stale else "up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
