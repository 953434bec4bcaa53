"""YAML files and ``--section.key`` flags into the checked config dataclasses, on draccus.

Precedence: dataclass defaults < YAML file (``--config``) or a resumed run's saved config <
flags. draccus builds the flags from the dataclasses (with each field's comment as its help),
reads every value as YAML (``--run.progress false``, ``--model.height null``) and decodes the
merged mapping into typed sections (``Literal`` choices, optional and list fields). This module
adds what a user relies on: one-line errors naming the key and the fix, a suggestion for a
misspelt key, comma lists (``--run.export merged,lora``), YAML files that refuse a key given twice,
and the migration of a run's config saved by an earlier version.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import draccus
import yaml
from draccus.cfgparsing import parse_string
from draccus.utils import DecodingError, DraccusException, ParsingError

from chunk_grpo.config.checks import field_types, literal_choices, section_names
from chunk_grpo.config.cli_args import OneLineArgumentParser, add_verbose
from chunk_grpo.config.describe import field_comments, type_name, yaml_value
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.reward_spec import RewardSpecError, format_reward_spec, parse_reward_spec
from chunk_grpo.config.schema import TrainConfig

C = TypeVar("C")


# ----------------------------------------------------------------------------- decoding

def _paths(cls: type) -> list[str]:
    return [f"{section}.{key}" for section, sub in section_names(cls).items()
            for key in field_types(sub)]


def _unknown_key(cls: type, key: str, where: str) -> ConfigError:
    """The error for an unknown key, suggesting the path whose key matches (the right key in
    the wrong section, or without its section) or the closest spelling."""
    paths, leaf = _paths(cls), key.rpartition(".")[2]
    renamed = [_RENAMED[key]] if cls is TrainConfig and key in _RENAMED else []
    close = renamed or [p for p in paths if p.endswith("." + leaf)] or \
        difflib.get_close_matches(key, paths, n=1)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return ConfigError(f"unknown config key {key!r} in {where}{hint}")


def _shorthand(hint: Any, path: str, value: Any) -> Any:
    """The YAML shorthands a field takes besides its type: a comma list for a list of names,
    a YAML list for a chunk layout, a mapping for a reward mix."""
    if typing.get_origin(hint) is list and isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if hint is str and isinstance(value, list):  # chunks.spec: [2, 3, 4, 7]
        return ",".join(str(v) for v in value)
    if hint is str and isinstance(value, Mapping) and path in ("reward.name", "eval.guard_reward"):
        try:
            return format_reward_spec(parse_reward_spec(value))  # {pickscore: 1.0, clip: 0.5}
        except RewardSpecError as err:
            raise ConfigError(f"{path}: {err}") from None
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # chunks.spec: 5
    return value


def _prepared(cls: type, data: Mapping[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """``data`` (nested sections, dotted keys or both) as {section: {key: value}}: keys checked,
    shorthands expanded; a key given twice is a ConfigError."""
    sections, out, given = section_names(cls), {}, set()
    for key, value in data.items():
        key = str(key)
        if "." in key:
            items = [(key, value)]
        elif key in sections:
            if value is None:  # `optim:` with nothing under it
                continue
            if not isinstance(value, Mapping):
                first = next(iter(field_types(sections[key])))
                raise ConfigError(f"{key} in {where} is a section: give it a mapping such as "
                                  f"`{key}: {{{first}: ...}}` or a dotted key `{key}.{first}`, "
                                  f"not {value!r}")
            items = [(f"{key}.{k}", v) for k, v in value.items()]
        else:
            raise _unknown_key(cls, key, where)
        for path, leaf_value in items:
            section, _, leaf = path.partition(".")
            hints = field_types(sections[section]) if section in sections else {}
            if leaf not in hints:
                raise _unknown_key(cls, path, where)
            if leaf_value is None and type(None) not in typing.get_args(hints[leaf]):
                raise ConfigError(f"{path} cannot be null; give {_a(type_name(hints[leaf]))}")
            if path in given:
                raise ConfigError(f"{path} is given twice in {where}; give it once")
            given.add(path)
            out.setdefault(section, {})[leaf] = _shorthand(hints[leaf], path, leaf_value)
    return out


def dotted_keys(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """{dotted key: value} of a mapping with nested sections, dotted keys or both; checked."""
    return {f"{section}.{key}": value for section, keys in
            _prepared(TrainConfig, data, where).items() for key, value in keys.items()}


def _config_error(err: Exception, cls: type, data: Mapping[str, Any]) -> ConfigError:
    """The ConfigError a section's check raised inside draccus, or draccus's own error (a value
    of the wrong type) in one line naming the key and what it takes."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, ConfigError):
            return cause
        cause = cause.__cause__ or cause.__context__
    if isinstance(err, DecodingError) and len(err.key_path) == 2:
        section, key = err.key_path
        hint = field_types(section_names(cls)[section])[key]
        value = data[section][key]
        return ConfigError(f"{section}.{key} must be {_a(type_name(hint))}, got {value!r}")
    return ConfigError(" ".join(str(err).split()))


def _a(kind: str) -> str:
    """``an int``, ``a float or null``, ``one of a, b``."""
    if kind.startswith(("one of", "list")):
        return kind
    if kind == "bool":
        return "true or false"
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def decode_config(cls: type[C], data: Mapping[str, Any], where: str) -> C:
    """A checked ``cls`` (a dataclass of sections) from a mapping as YAML holds it."""
    prepared = _prepared(cls, data, where)
    try:
        return draccus.decode(cls, prepared)
    except (DecodingError, ParsingError, DraccusException, ValueError, TypeError) as err:
        raise _config_error(err, cls, prepared) from None


def config_values(cfg: Any) -> dict[str, Any]:
    """{section: {key: value}} of a config: what `decode_config` reads back."""
    return dataclasses.asdict(cfg)


def merge_overrides(cfg: C, *layers: tuple[Mapping[str, Any], str]) -> C:
    """A checked copy of ``cfg`` with each (mapping of dotted or nested keys, where it comes
    from) applied in turn, the last winning."""
    values = config_values(cfg)
    for data, where in layers:
        for section, keys in _prepared(type(cfg), data, where).items():
            values[section].update(keys)
    return decode_config(type(cfg), values, layers[-1][1] if layers else "the defaults")


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
        layers.append((migrate_saved(data) if saved else data, str(yaml_path)))
    return merge_overrides(TrainConfig(), *layers, (overrides or {}, "the overrides"))


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """The nested form (one mapping per section) that `build_config` reads back."""
    Path(path).write_text(yaml.safe_dump(config_values(cfg), sort_keys=False))


# ----------------------------------------------------------------------------- old saved runs

# Runs saved by versions before the sections kept every setting at the top level, under these
# names where the name is not the setting's key (the others: the key itself, e.g. lr).
_RENAMED = {
    "model": "model.name", "reward": "reward.name", "reward_device": "reward.device",
    "reward_batch_size": "reward.batch_size", "reward_overlap": "reward.overlap",
    "reward_timeout": "reward.timeout", "num_steps": "sampling.steps", "sde_kind": "sampling.sde",
    "rollout_batch_size": "sampling.batch_size", "chunks": "chunks.spec",
    "chunk_size": "chunks.size", "chunk_fraction": "chunks.fraction",
    "weighted_chunks": "chunks.weighted", "max_chunk_size": "chunks.max_size",
    "optimizer": "optim.name", "adam_beta1": "optim.beta1", "adam_beta2": "optim.beta2",
    "adam_eps": "optim.eps", "lr_schedule": "optim.schedule", "parallelism": "parallel.mode",
    "device": "run.device", "eval_every": "eval.every", "eval_images": "eval.images",
    "final_eval_images": "eval.final_images", "eval_hybrid_steps": "eval.hybrid_steps",
}


def migrate_saved(data: Mapping[str, Any]) -> dict[str, Any]:
    """A saved run config in today's dotted keys: top-level settings of an earlier version go to
    their section (``lr`` -> ``optim.lr``, ``num_steps`` -> ``sampling.steps``)."""
    sections = section_names(TrainConfig)
    owner = {}  # key -> its only path, for keys that name one setting
    for path in _paths(TrainConfig):
        owner.setdefault(path.partition(".")[2], []).append(path)
    out = {}
    for key, value in data.items():
        flat = key not in sections or not isinstance(value, Mapping) or key == "reward" and not (
            set(value) <= set(field_types(sections["reward"])))
        if not flat:
            out[key] = value
        elif key in _RENAMED:
            out[_RENAMED[key]] = value
        elif len(owner.get(key, ())) == 1:
            out[owner[key][0]] = value
        else:
            out[key] = value  # unknown: decode_config names it
    return out


def config_from_saved(data: Mapping[str, Any],
                      where: str = "the checkpoint's config") -> TrainConfig:
    """A run's saved config (config.yaml or a checkpoint's copy), from any version."""
    return merge_overrides(TrainConfig(), (migrate_saved(data), where))


def load_saved_config(path: str | Path) -> TrainConfig:
    """A run directory's config.yaml, nested or the flat form of earlier versions."""
    return build_config(path, saved=True)


# ----------------------------------------------------------------------------- flags

class ConfigArgumentParser(OneLineArgumentParser):
    """A command's parser: a ``--section.key`` flag for every key of a config made of sections
    (listed by section, each with its comment, type and default), plus the command's own flags.
    `parse` returns the values as YAML reads them; draccus decodes them with the base."""

    def __init__(self, config_class: type, prog: str, description: str, usage: str) -> None:
        super().__init__(prog=prog, description=description, usage=usage, allow_abbrev=False,
                         formatter_class=_HelpFormatter)
        self.config_class, self.config_dests = config_class, set()
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
                self.config_dests.add(path)

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
            raise _unknown_key(self.config_class, key, "the command line")
        values = vars(values)
        config = {k: parse_string(values.pop(k)) for k in list(values) if k in self.config_dests}
        return values, config


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
    _prepared(TrainConfig, overrides, "the command line")  # a misspelt key: before any file
    result = (own.get("config"), overrides, own.get("resume"))
    return (*result, bool(own.get("trust_checkpoint"))) if trust_flag else result
