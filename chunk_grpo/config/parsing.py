"""YAML files and ``--section.key`` flags into the checked training config.

Precedence: dataclass defaults < YAML file (``--config``) or a resumed run's saved config <
flags. Every value is read as YAML (draccus's reader: ``--run.progress false``,
``--model.height null``) and the merged mapping decoded by `chunk_grpo.config.decoding`. Here:
the YAML files (a key given twice is refused), the saved run configs, and the parsers, one flag
per key listed by section with its comment, type and default.
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from draccus.cfgparsing import parse_string

from chunk_grpo.config.checks import field_types, literal_choices, section_names
from chunk_grpo.config.cli_args import OneLineArgumentParser, add_verbose
from chunk_grpo.config.decoding import (
    config_values,
    merge_overrides,
    migrate_saved,
    section_values,
    unknown_key,
)
from chunk_grpo.config.describe import field_comments, type_name, yaml_value
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.schema import TrainConfig

C = TypeVar("C")


# ----------------------------------------------------------------------------- YAML

class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                mark = key_node.start_mark
                raise _DuplicateKey(f"line {mark.line + 1}, column {mark.column + 1} gives the "
                                    f"key {key!r} a second time in one mapping; give it once")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping; a missing, undecodable or malformed file is a ConfigError naming the file
    (and the line)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except _DuplicateKey as err:
        raise ConfigError(f"config file {str(path)!r}: {err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {str(path)!r} as UTF-8 text: {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file {str(path)!r}{where} is not valid YAML ({problem}); "
                          "fix it, e.g. write `key: value` with a space after the colon") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys to values")
    return data


def build_config(yaml_path: str | Path | None = None,
                 overrides: Mapping[str, Any] | None = None, *,
                 saved: bool = False) -> TrainConfig:
    """Defaults, then the YAML file, then ``overrides`` (dotted or nested keys); checked.
    ``saved``: the file is a run's saved config.yaml, from any version (`migrate_saved`)."""
    layers = []
    if yaml_path is not None:
        data = load_yaml(yaml_path)
        layers.append((migrate_saved(TrainConfig, data) if saved else data, str(yaml_path)))
    return merge_overrides(TrainConfig(), *layers, (overrides or {}, "the overrides"))


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """The nested form (one mapping per section) that `build_config` reads back."""
    Path(path).write_text(yaml.safe_dump(config_values(cfg), sort_keys=False))


# ----------------------------------------------------------------------------- old saved runs

def config_from_saved(data: Mapping[str, Any],
                      where: str = "the checkpoint's config") -> TrainConfig:
    """A run's saved config (config.yaml or a checkpoint's copy), from any version."""
    return merge_overrides(TrainConfig(), (migrate_saved(TrainConfig, data), where))


def load_saved_config(path: str | Path) -> TrainConfig:
    """A run directory's config.yaml, nested or the flat form of earlier versions."""
    return build_config(path, saved=True)


# ----------------------------------------------------------------------------- flags

class ConfigArgumentParser(OneLineArgumentParser):
    """A command's parser: a ``--section.key`` flag for every key of a config made of sections
    (listed by section, each with its comment, type and default), plus the command's own flags.
    `parse` returns the values as YAML reads them; draccus decodes them with the base."""

    def __init__(self, config_class: type, prog: str, description: str, usage: str,
                 renamed: Mapping[str, str] | None = None) -> None:
        """``renamed``: {a former flag's key: the dotted key it became}, for the error that
        answers an old flag (``prompts_file``: ``data.train_prompts``)."""
        super().__init__(prog=prog, description=description, usage=usage, allow_abbrev=False,
                         formatter_class=_HelpFormatter)
        self.config_class, self.config_dests = config_class, {}
        self.renamed = dict(renamed or {})
        defaults = config_class()
        for section, cls in section_names(config_class).items():
            group = self.add_argument_group(section, (cls.__doc__ or "").strip())
            comments = field_comments(cls)
            for key, hint in field_types(cls).items():
                path = f"{section}.{key}"
                default = yaml_value(getattr(getattr(defaults, section), key))
                text = "; ".join(p for p in (comments.get(key, ""), f"default {default}") if p)
                group.add_argument(f"--{path}", dest=path, default=argparse.SUPPRESS,
                                   metavar=_metavar(hint), help=text.replace("%", "%%"))
                self.config_dests[path] = hint

    def parse(self, argv: list[str] | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """({own flag: value}, {dotted key: value as YAML reads it}); a bad flag is a
        ConfigError naming it."""
        argv, seen = list(sys.argv[1:] if argv is None else argv), set()
        for i, word in enumerate(argv):
            name, eq, value = word.partition("=")
            if word.startswith("--") and "." in name:  # a key: --optim.max-grad-norm too
                argv[i] = name[:2] + name[2:].replace("-", "_") + eq + value
                if argv[i].partition("=")[0] in seen:
                    raise ConfigError(f"{name[2:].replace('-', '_')} is given twice on the "
                                      "command line; give it once")
                seen.add(argv[i].partition("=")[0])
        values, unknown = self.parse_known_args(argv)
        if unknown:
            word = next((w for w in unknown if w.startswith("-")), unknown[0])
            if not word.startswith("-"):
                raise ConfigError(f"unexpected argument {word!r}: settings are --section.key "
                                  "VALUE (see --help)")
            key = word.lstrip("-").split("=")[0].replace("-", "_")
            if key in section_names(self.config_class):
                first = next(iter(field_types(section_names(self.config_class)[key])))
                raise ConfigError(f"--{key} is a section; set its keys, e.g. --{key}.{first} "
                                  "VALUE (see --help)")
            raise unknown_key(self.config_class, key, "the command line", self.renamed)
        values = vars(values)
        config = {k: _flag_value(self.config_dests[k], values.pop(k))
                  for k in list(values) if k in self.config_dests}
        return values, config

    def parse_config(self, argv: list[str] | None) -> tuple[dict[str, Any], Any]:
        """({own flag: value}, the checked config): its defaults, then the YAML file of
        ``--config`` when the command has that flag and it is given, then the flags."""
        own, overrides = self.parse(argv)
        section_values(self.config_class, overrides, "the command line")  # a misspelt key: first
        layers = [(load_yaml(own["config"]), str(own["config"]))] if own.get("config") else []
        return own, merge_overrides(self.config_class(), *layers,
                                    (overrides, "the command line"))


def _flag_value(hint: Any, text: str) -> Any:
    """A flag's value as YAML reads it, but a word for a text field stays the word: YAML reads
    ``no`` and ``on`` as booleans (``--model.mixed_precision no``, ``--reward.name on``)."""
    value = parse_string(text)
    if isinstance(value, bool) and _takes_text(hint):
        return text
    return value


def _takes_text(hint: Any) -> bool:
    choices = literal_choices(hint)
    if choices is not None:
        return all(isinstance(c, str) for c in choices)
    return hint is str or str in typing.get_args(hint)


def _metavar(hint: Any) -> str:
    choices = literal_choices(hint)
    if choices is not None:
        return "{" + ",".join(map(str, choices)) + "}"
    if typing.get_origin(hint) is list:
        return "A,B,..."
    return type_name(hint).replace(" or null", "|null").upper()


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=40, width=100)


TRAIN_DESCRIPTION = (
    "Chunk-GRPO fine-tuning of a flow-matching text-to-image model. With no arguments:\nthe "
    "embedded tiny FLUX on JPEG compressibility, held to the prompt by shapes-clip (CPU).\n\n"
    "Every setting is --section.key VALUE (or --section.key=VALUE), listed by section below;\n"
    "values are read as YAML: true, null, 1e-4, [2, 3]; lists also as a,b.")


def train_parser(prog: str, *, trust_flag: bool = False) -> ConfigArgumentParser:
    parser = ConfigArgumentParser(
        TrainConfig, prog, TRAIN_DESCRIPTION,
        "%(prog)s [--config YAML | --resume DIR] [--section.key VALUE ...]")
    parser.add_argument("--config", metavar="YAML",
                        help="YAML preset, e.g. configs/flux_dev_hpsv3.yaml")
    parser.add_argument("--resume", metavar="DIR",
                        help="run directory to continue (its saved config is the base; flags "
                             "given here override it)")
    add_verbose(parser)
    if trust_flag:
        parser.add_argument("--trust-checkpoint", dest="trust_checkpoint", action="store_true",
                            help="resume from a checkpoint without a manifest.json (one you "
                                 "trust; still read as tensors and plain values only)")
    return parser


def parse_args(argv: list[str] | None = None, prog: str = "python -m chunk_grpo.train",
               *, trust_flag: bool = False) -> tuple:
    """``python -m chunk_grpo.train``'s arguments: (YAML path, overrides {dotted key: value},
    resume dir), and with ``trust_flag`` a fourth value, whether --trust-checkpoint was given."""
    own, overrides = train_parser(prog, trust_flag=trust_flag).parse(argv)
    if own.get("config") and own.get("resume"):
        raise ConfigError("give either --config or --resume: a resumed run uses its saved config")
    section_values(TrainConfig, overrides, "the command line")  # a misspelt key: before any file
    result = (own.get("config"), overrides, own.get("resume"))
    return (*result, bool(own.get("trust_checkpoint"))) if trust_flag else result
