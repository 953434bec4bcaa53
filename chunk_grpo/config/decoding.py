"""Mappings as YAML holds them into checked config dataclasses, on draccus.

draccus decodes a nested mapping into typed sections (``Literal`` choices, optional and list
fields, each section's ``__post_init__`` checks). This module adds what a user relies on around
it: keys checked first with a suggestion for a misspelt one, the YAML shorthands (a comma list, a
list for a chunk layout, a mapping for a reward mix), every error in one line naming the key,
and the migration of a run's config saved by an earlier version (settings at the top level).
Generic over any dataclass of sections; torch-free.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import draccus
from draccus.utils import DecodingError, DraccusException, ParsingError

from chunk_grpo.config.checks import field_types, key_paths, section_names, yaml_word_note
from chunk_grpo.config.describe import type_name
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.reward_spec import RewardSpecError, format_reward_spec, parse_reward_spec

C = TypeVar("C")


def unknown_key(cls: type, key: str, where: str,
                renamed: Mapping[str, str] | None = None) -> ConfigError:
    """The error for an unknown key, suggesting the key it became (`_RENAMED`, or a command's
    own ``renamed`` flags), the path whose key matches (the right key in the wrong section, or
    without its section) or the closest spelling."""
    paths, leaf = key_paths(cls), key.rpartition(".")[2]
    became = {**_RENAMED, **(renamed or {})}.get(key)
    renamed = [became] if became in paths else []
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


def section_values(cls: type, data: Mapping[str, Any], where: str) -> dict[str, dict[str, Any]]:
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
            raise unknown_key(cls, key, where)
        for path, leaf_value in items:
            section, _, leaf = path.partition(".")
            hints = field_types(sections[section]) if section in sections else {}
            if leaf not in hints:
                raise unknown_key(cls, path, where)
            if leaf_value is None and type(None) not in typing.get_args(hints[leaf]):
                raise ConfigError(f"{path} cannot be null; give {_a(type_name(hints[leaf]))}")
            if path in given:
                raise ConfigError(f"{path} is given twice in {where}; give it once")
            given.add(path)
            out.setdefault(section, {})[leaf] = _shorthand(hints[leaf], path, leaf_value)
    return out


def dotted_keys(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """{dotted key: value} of a mapping with nested sections, dotted keys or both; checked."""
    return {f"{section}.{key}": value for section, keys in
            section_values(cls, data, where).items() for key, value in keys.items()}


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
        kind = type_name(hint)
        sep = ";" if kind.startswith("one of") else ","  # as the sections' own checks say it
        return ConfigError(f"{section}.{key} must be {_a(kind)}{sep} got {value!r}"
                           f"{yaml_word_note(value)}")
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
    prepared = section_values(cls, data, where)
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
        for section, keys in section_values(type(cfg), data, where).items():
            values[section].update(keys)
    return decode_config(type(cfg), values, layers[-1][1] if layers else "the defaults")



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


def migrate_saved(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """A saved run config in today's dotted keys: top-level settings of an earlier version go to
    their section (``lr`` -> ``optim.lr``, ``num_steps`` -> ``sampling.steps``)."""
    sections = section_names(cls)
    owner = {}  # key -> its only path, for keys that name one setting
    for path in key_paths(cls):
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
