"""The checks the config sections run in ``__post_init__``: one-line errors naming the key.

A section checks its own values (`check_section`: choices, finite numbers, ranges, then its own
rules); `TrainConfig` checks what spans sections (`check_across_sections`). Torch-free, so every
command checks its flags before it loads a model.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import re
import typing
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.reward_spec import RewardSpecError, parse_reward_spec, resolve_guard_spec
from chunk_grpo.config.specs import ChunkSpecError, chunk_sizes, export_formats

if TYPE_CHECKING:
    from chunk_grpo.config.schema import TrainConfig


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """{field: resolved annotation} of a dataclass (annotations are strings under PEP 563)."""
    return typing.get_type_hints(cls)


def literal_choices(hint: Any) -> tuple | None:
    """The allowed values of a ``Literal[...]`` field, also inside ``Optional``; else None."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    for arg in typing.get_args(hint):
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)
    return None


def yaml_word_note(value: Any) -> str:
    """The hint for a boolean where a word was meant: YAML reads ``no`` as false."""
    return (" (YAML reads an unquoted yes, no, on or off as true or false: quote the word)"
            if isinstance(value, bool) else "")


def check_section(section: Any, name: str, *, at_least: Mapping[str, int] = {},
                  positive: Iterable[str] = (), non_negative: Iterable[str] = (),
                  unit_interval: Iterable[str] = ()) -> None:
    """Every choice allowed, every float finite, and each named field in its range (None passes
    where the field allows it). ``name``: the section's key in the config, for the messages."""
    for key, hint in field_types(type(section)).items():
        value = getattr(section, key)
        choices = literal_choices(hint)
        if choices is not None and value not in choices and value is not None:
            raise ConfigError(f"{name}.{key} must be one of {', '.join(map(str, choices))}; "
                              f"got {value!r}{yaml_word_note(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}.{key} must be a finite number, got {value}")
    for key, low in at_least.items():
        value = getattr(section, key)
        if value is not None and value < low:
            raise ConfigError(f"{name}.{key} must be >= {low}, got {value}")
    for keys, bad, rule in ((positive, lambda v: v <= 0, "> 0"),
                            (non_negative, lambda v: v < 0, ">= 0"),
                            (unit_interval, lambda v: not 0 <= v < 1, "in [0, 1)")):
        for key in keys:
            value = getattr(section, key)
            if value is not None and bad(value):
                raise ConfigError(f"{name}.{key} must be {rule}, got {value}")


def check_image_size(section: Any, name: str) -> None:
    """``height`` and ``width``: at least 16 pixels, or None for the model's own size."""
    for key in ("height", "width"):
        value = getattr(section, key)
        if value is not None and value < 16:
            raise ConfigError(f"{name}.{key} must be >= 16 pixels or null (the model's size), "
                              f"got {value}")


def check_reward_device(key: str, device: str, empty: str) -> None:
    """A reward's device: "" (``empty`` says what that means), cpu, cuda or cuda:N."""
    if not re.fullmatch(r"|cpu|cuda(:\d+)?", device):
        raise ConfigError(f"{key} must be '' ({empty}), cpu, cuda or cuda:N; got {device!r}")


def check_reward_spec(key: str, spec: str, also: str = "") -> None:
    try:
        parse_reward_spec(spec)
    except RewardSpecError as err:
        raise ConfigError(f"{key}: {err}{also}") from None


def check_across_sections(cfg: TrainConfig) -> None:
    """The rules that tie one section's values to another's."""
    s, lo = cfg.sampling, cfg.loss
    try:
        chunk_sizes(cfg.chunks.spec, cfg.num_trained, cfg.chunks.size)
    except ChunkSpecError as err:
        raise ConfigError(f"chunks.spec: {err}") from None
    if s.group_size < 2 and lo.adv_norm != "none":
        raise ConfigError("sampling.group_size must be >= 2 for group advantages; set "
                          "loss.adv_norm: none for single samples")
    try:
        export_formats(cfg.run.export, cfg.model.lora_rank > 0)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_guard(cfg)
    _check_quantization(cfg)


def _check_guard(cfg: TrainConfig) -> None:
    """An early stop on the guard can happen: a guard to watch, periodic evaluations, the base
    model to compare with, and images enough for a confidence interval."""
    ev = cfg.eval
    if ev.guard_stop <= 0:
        return
    stop = f"eval.guard_stop {ev.guard_stop:g}"
    spec = resolve_guard_spec(ev.guard_reward, reward=cfg.reward.name,
                              eval_prompts=cfg.data.eval_prompts)
    if spec is None:
        why = ("none" if ev.guard_reward.strip().lower() == "none" else
               "auto, which finds no guard here (it is the shapes checks on shapes: evaluation "
               "prompts when the trained reward is not shapes)")
        raise ConfigError(f"{stop} has no guard to watch: eval.guard_reward is {why}; name one "
                          "(e.g. eval.guard_reward: shapes) or set eval.guard_stop: 0")
    if ev.every == 0:
        raise ConfigError(f"{stop} is checked at the periodic evaluations, and eval.every: 0 runs "
                          "none; set eval.every >= 1 or eval.guard_stop: 0")
    if ev.hybrid_steps == 0:
        raise ConfigError(f"{stop} compares the guard with the base model's on the same images, "
                          "and eval.hybrid_steps: 0 loads no base; set eval.hybrid_steps >= 1 "
                          "(e.g. 8) or eval.guard_stop: 0")
    if ev.images < 2:
        raise ConfigError(f"{stop} needs a confidence interval of the guard's change: set "
                          f"eval.images >= 2 (e.g. 32), got {ev.images}")


def _check_quantization(cfg: TrainConfig) -> None:
    """A quantized base is QLoRA: adapters on frozen bitsandbytes layers, never sharded."""
    kind = cfg.model.base_quantization
    if kind == "none":
        return
    key = f"model.base_quantization {kind}"
    if cfg.model.lora_rank == 0:
        raise ConfigError(f"{key} needs model.lora_rank > 0: the quantized base is frozen and "
                          "only LoRA adapters train on it (QLoRA); set e.g. model.lora_rank: 64, "
                          "or model.base_quantization: none")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"{key} needs bitsandbytes: pip install bitsandbytes, or set "
                          "model.base_quantization: none")
    if cfg.parallel.mode == "fsdp":
        raise ConfigError(f"{key} cannot be sharded with parallel.mode: fsdp (FSDP2 shards "
                          "parameters as DTensors, which drops bitsandbytes' quantized weight "
                          "class and its quantization state); use parallel.mode: none on one GPU "
                          "or ddp")


def section_names(cls: type) -> dict[str, type]:
    """{section key: section class} of a config made of sections (`TrainConfig`)."""
    return {f.name: field_types(cls)[f.name] for f in dataclasses.fields(cls)}


def key_paths(cls: type) -> tuple[str, ...]:
    """Every key's dotted path (``optim.lr``) of a config made of sections, in field order."""
    return tuple(f"{section}.{key}" for section, sub in section_names(cls).items()
                 for key in field_types(sub))
