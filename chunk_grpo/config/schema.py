"""The training configuration: one dataclass per section, YAML presets, command-line overrides.

Precedence: dataclass defaults < YAML file (``--config``) < command-line flags. A setting is
named by its dotted path, ``section.key`` (``--optim.lr 1e-4``, ``--optim.lr=1e-4``, or in YAML
``optim: {lr: 1e-4}`` / ``optim.lr: 1e-4``). The flat names of earlier versions stay as aliases
(`FLAT_ALIASES`: ``--lr``, ``--group-size``, ``lr:`` in a YAML file, ``{"group_size": 4}`` as an
override), so old presets, saved run configs and commands keep working. Unknown keys are errors
that suggest the closest valid name.

Torch-free: it imports nothing that needs torch, so every command parses and checks its flags
before loading a model (`chunk_grpo.cli`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from chunk_grpo.config.checks import CHOICES, check_config
from chunk_grpo.config.cli_args import OneLineArgumentParser
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.reward_spec import RewardSpecError, format_reward_spec, parse_reward_spec
from chunk_grpo.config.specs import trained_transitions

# ----------------------------------------------------------------------------- the sections

@dataclass
class ModelConfig:
    """The policy: which model, its size, precision and what is trained."""

    name: str = "embedded"  # diffusers directory or hub id; "embedded" = shipped tiny FLUX
    height: int | None = None  # None = the model's default size
    width: int | None = None
    mixed_precision: str = "auto"  # auto (bf16 where native, else fp32) | no | bf16
    weights_dtype: str = "auto"  # frozen weights and the base: auto (bf16 on CUDA, else fp32)
    attention_backend: str = "auto"  # auto (flash if installed, else native) | native | flash
    gradient_checkpointing: bool = False
    compile_blocks: bool = False  # torch.compile each transformer block
    lora_rank: int = 8  # 0 = full fine-tuning
    lora_alpha: float | None = None  # None = lora_rank
    # LoRA's frozen base in 4 or 8 bits (QLoRA, bitsandbytes; chunk_grpo.models.quantize)
    base_quantization: str = "none"  # none | nf4 | int8
    # a preset (attention | attention+text | all: chunk_grpo.config.specs.LORA_PRESETS)
    # or module names
    lora_targets: list[str] = field(default_factory=lambda: ["attention+text"])
    guidance: float | None = None  # FLUX.1-dev's distilled guidance; None = the model's default
    text_encoders: str = "keep"  # keep (on the device) | cache (embed once, free them) | cpu
    prompt_cache_dir: str = ""  # text_encoders: cache; "" = ~/.cache/chunk_grpo/prompt_embeds
    tf32: bool = True  # CUDA fp32 matmuls and convolutions in TF32 (no effect on the CPU)


@dataclass
class RewardConfig:
    """What the images are scored with."""

    # a registered name, module:name, remote:URL, or a mix "a=1.0,b=0.5"
    # The embedded default: DDPO's JPEG compressibility, held to the prompt by a tenth of the
    # shapes world's learned CLIP score (alone, JPEG learns empty canvases: docs/results)
    name: str = "jpeg_compressibility=1,shapes-clip=0.1"
    mix_advantage: str = "total"  # total (of the weighted sum) | per_reward (each normalised)
    device: str = ""  # "" = the trainer's device; rewards get bf16 on CUDA, fp32 on CPU
    batch_size: int = 0  # images per reward call; 0 = a whole rollout batch
    overlap: bool = True  # score rollout batch i while batch i+1 is sampled
    timeout: float = 0.0  # seconds a rollout batch's reward call may take; 0 = no limit


@dataclass
class DataConfig:
    """The prompt sets."""

    train_prompts: str = "shapes:rl"  # a prompt file, or shapes:rl / shapes:train / shapes:heldout
    eval_prompts: str = "shapes:heldout"


@dataclass
class SamplingConfig:
    """The rollouts: the algorithm, the sampler and the groups."""

    algorithm: str = "chunk_grpo"  # chunk_grpo | g2rpo (singular branch step, several finishes)
    g2rpo_granularities: str = "1,2"  # g2rpo: ODE strides of the finishes after the branch
    steps: int = 10  # T: sampling steps in training; the last transition is not trained
    shift: float = 3.0
    dynamic_shift: bool = False  # FLUX's resolution-dependent shift from the token count instead
    sde: str = "flow"  # flow | dance | cps | cps_mse
    eta: float = 0.7
    cfg_scale: float | None = None  # None = the model's default_cfg_scale
    group_size: int = 8  # G images per prompt
    prompts_per_step: int = 8  # prompts per rank per iteration
    shared_noise: bool = True  # same initial noise for the whole group
    antithetic_noise: bool = False  # image pairs in a group draw opposite noise (even G)
    sde_window: int = 6  # k > 0: only the first k steps are SDE (and trained), the rest ODE
    decode: str = "final"  # final latent | x0 (the last step's clean prediction)
    batch_size: int = 64  # rows per rollout transformer call


@dataclass
class ChunksConfig:
    """How the trained transitions are split into chunks, and which are trained."""

    spec: str = "auto"  # "2,3,4,7" | "auto" | "step" | "sequence"
    size: int | None = None  # fixed-size chunks; overrides `spec`
    fraction: float = 0.5  # fraction of chunks trained per iteration
    weighted: bool = False  # draw chunks with weight ~ mean relative change
    profile_prompts: int = 16  # prompts used for the temporal-dynamics profile
    max_size: int = 5  # auto chunking splits longer segments


@dataclass
class LossConfig:
    """Advantages, the clipped ratio and the KL term."""

    adv_norm: str = "group"  # group | global | none
    adv_clip_max: float | None = 5.0
    adv_eps: float = 1e-4
    clip_low: float = 1e-3  # ratios of mean-reduced step log-probs stay within ~1e-3
    clip_high: float = 1e-3
    kl_coef: float = 0.0
    kl_ref: str = "old"  # old (k3 vs the rollout policy) | reference (the base model)


@dataclass
class OptimConfig:
    """The optimizer, its schedule, and how the batch is split into optimizer steps."""

    name: str = "adamw"  # adamw | adamw8bit
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_steps: int = 0  # optimizer steps of linear warm-up
    schedule: str = "constant"  # constant | cosine
    micro_batch_size: int = 8  # rows per training call (call batch = trained steps x this)
    grad_accum: int = 0  # micro-batches per optimizer step (0 = all of an iteration)
    ppo_epochs: int = 1  # passes over each batch of rollouts
    ema_decay: float = 0.0  # 0 = no EMA


@dataclass
class ParallelConfig:
    """Several processes (torchrun) and memory."""

    mode: str = "ddp"  # ddp | fsdp (FSDP2, a shard per transformer block) | none
    cpu_offload: bool = False  # fsdp: keep parameters, gradients and optimizer state on the CPU
    reduce_dtype: str = "fp32"  # fsdp: the dtype gradients are reduce-scattered in (fp32 | bf16)
    # how long a collective may wait for the other ranks (start-up encodes prompts, loads and
    # profiles the model while they wait) before the job fails
    timeout_minutes: float = 60.0


@dataclass
class EvalConfig:
    """The held-out evaluations."""

    every: int = 50  # iterations between evaluations (0 = only at the end)
    images: int = 32  # held-out images per periodic evaluation
    final_images: int = 256  # held-out images of the final evaluation (the run's summary)
    hybrid_steps: int = 8  # >0: also evaluate hybrid inference, this many policy steps
    # a second reward scored beside the trained one (rollouts, evaluations, summary): a reward
    # spec as --reward takes it; auto = the shapes checks on shapes: prompts; none = off
    guard_reward: str = "auto"
    # stop when a periodic evaluation's paired guard change lies below -guard_stop with its
    # whole 95% CI (0 = never stop)
    guard_stop: float = 0.0


@dataclass
class RunConfig:
    """The run: where, how long, logging, checkpoints and faults."""

    output_dir: str = ""  # "" = runs/<timestamp>
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    max_steps: int = 400  # training iterations (rollout + update)
    max_minutes: float = 10.0  # stop after this much training wall time (0 = no limit)
    log_every: int = 1
    image_grid_every: int = 25  # iterations between rollout image grids (0 = never)
    checkpoint_every: int = 25  # iterations between checkpoints (0 = only at the end)
    keep_checkpoints: int = 2
    max_bad_steps: int = 3  # consecutive non-finite steps before the run stops
    progress: bool = True
    # what is written at the end: auto (merged, plus lora on a LoRA run) | merged | lora |
    # transformer, several allowed (chunk_grpo.train.export)
    export: list[str] = field(default_factory=lambda: ["auto"])
    # where metrics, image grids and the summary go: tensorboard | jsonl | wandb, several allowed
    report_to: list[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])
    name: str = ""  # the run's name (in wandb); "" = the run directory's name
    wandb_project: str = "chunk-grpo"


# The flat names of earlier versions, each an alias of one dotted path (command line, YAML,
# override dicts). Fixed: a saved config.yaml of an old run keeps loading; settings added since
# (model.tf32, parallel.timeout_minutes) have only their dotted path.
FLAT_ALIASES: dict[str, str] = {
    "model": "model.name", "height": "model.height", "width": "model.width",
    "mixed_precision": "model.mixed_precision", "weights_dtype": "model.weights_dtype",
    "attention_backend": "model.attention_backend",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "compile_blocks": "model.compile_blocks", "lora_rank": "model.lora_rank",
    "lora_alpha": "model.lora_alpha", "lora_targets": "model.lora_targets",
    "guidance": "model.guidance", "text_encoders": "model.text_encoders",
    "prompt_cache_dir": "model.prompt_cache_dir",
    "reward": "reward.name", "mix_advantage": "reward.mix_advantage",
    "reward_device": "reward.device", "reward_batch_size": "reward.batch_size",
    "reward_overlap": "reward.overlap", "reward_timeout": "reward.timeout",
    "train_prompts": "data.train_prompts", "eval_prompts": "data.eval_prompts",
    "algorithm": "sampling.algorithm", "g2rpo_granularities": "sampling.g2rpo_granularities",
    "num_steps": "sampling.steps", "shift": "sampling.shift",
    "dynamic_shift": "sampling.dynamic_shift", "sde_kind": "sampling.sde",
    "eta": "sampling.eta", "cfg_scale": "sampling.cfg_scale", "group_size": "sampling.group_size",
    "prompts_per_step": "sampling.prompts_per_step", "shared_noise": "sampling.shared_noise",
    "antithetic_noise": "sampling.antithetic_noise", "sde_window": "sampling.sde_window",
    "decode": "sampling.decode", "rollout_batch_size": "sampling.batch_size",
    "chunks": "chunks.spec", "chunk_size": "chunks.size", "chunk_fraction": "chunks.fraction",
    "weighted_chunks": "chunks.weighted", "profile_prompts": "chunks.profile_prompts",
    "max_chunk_size": "chunks.max_size",
    "adv_norm": "loss.adv_norm", "adv_clip_max": "loss.adv_clip_max", "adv_eps": "loss.adv_eps",
    "clip_low": "loss.clip_low", "clip_high": "loss.clip_high", "kl_coef": "loss.kl_coef",
    "kl_ref": "loss.kl_ref",
    "optimizer": "optim.name", "lr": "optim.lr", "weight_decay": "optim.weight_decay",
    "adam_beta1": "optim.beta1", "adam_beta2": "optim.beta2", "adam_eps": "optim.eps",
    "max_grad_norm": "optim.max_grad_norm", "warmup_steps": "optim.warmup_steps",
    "lr_schedule": "optim.schedule", "micro_batch_size": "optim.micro_batch_size",
    "grad_accum": "optim.grad_accum", "ppo_epochs": "optim.ppo_epochs",
    "ema_decay": "optim.ema_decay",
    "parallelism": "parallel.mode", "cpu_offload": "parallel.cpu_offload",
    "reduce_dtype": "parallel.reduce_dtype",
    "eval_every": "eval.every", "eval_images": "eval.images",
    "final_eval_images": "eval.final_images", "eval_hybrid_steps": "eval.hybrid_steps",
    "output_dir": "run.output_dir", "seed": "run.seed", "device": "run.device",
    "max_steps": "run.max_steps", "max_minutes": "run.max_minutes", "log_every": "run.log_every",
    "image_grid_every": "run.image_grid_every", "checkpoint_every": "run.checkpoint_every",
    "keep_checkpoints": "run.keep_checkpoints", "max_bad_steps": "run.max_bad_steps",
    "progress": "run.progress",
}


@dataclass
class TrainConfig:
    """Every setting of a training run, by section (``cfg.optim.lr``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    chunks: ChunksConfig = field(default_factory=ChunksConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def num_trained(self) -> int:
        """W: the transitions with a log-prob, which the chunks split."""
        return trained_transitions(self.sampling.steps, self.sampling.sde_window)

    def get(self, key: str) -> Any:
        """The value of a dotted path (``"optim.lr"``) or flat alias (``"lr"``)."""
        section, leaf = resolve_key(key, "the configuration").split(".")
        return getattr(getattr(self, section), leaf)

    def with_changes(self, changes: Mapping[str, Any]) -> TrainConfig:
        """A copy with ``changes`` ({dotted path or flat alias: value}) applied, converted to
        each field's type but not validated (callers may need e.g. an infinite clip norm)."""
        new = copy.deepcopy(self)
        for path, (name, value) in _canonical(changes, "the changes").items():
            section, leaf = path.split(".")
            setattr(getattr(new, section), leaf, coerce(path, value, name))
        return new

    def validate(self, names: Mapping[str, str] | None = None) -> TrainConfig:
        """Raise ConfigError for any inconsistent value; returns self. ``names`` maps a dotted
        path to the key the user wrote (a flat alias), for the messages."""
        check_config(self, lambda path: (names or {}).get(path, path))
        return self

    def to_dict(self) -> dict[str, Any]:
        """{section: {key: value}}: the form config.yaml is saved in."""
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(TrainConfig)[f.name]
                             for f in dataclasses.fields(TrainConfig)}
_HINTS: dict[str, Any] = {f"{section}.{name}": hint for section, cls in SECTIONS.items()
                          for name, hint in typing.get_type_hints(cls).items()}
PATHS: tuple[str, ...] = tuple(_HINTS)


# ----------------------------------------------------------------------------- keys and values

def _unknown_key(key: str, where: str) -> ConfigError:
    """The error for an unknown key, suggesting the closest dotted path or flat alias."""
    section, _, leaf = key.rpartition(".")
    if section and section not in SECTIONS:
        close = difflib.get_close_matches(section, list(SECTIONS), n=1)
        hint = f"; did you mean section {close[0]!r}?" if close else (
            f"; the sections are {', '.join(SECTIONS)}")
        return ConfigError(f"unknown config section {section!r} (in key {key!r}) in {where}{hint}")
    # the right key in the wrong section, or a section's key without its section
    close = list(dict.fromkeys([p for p in PATHS if p.endswith("." + leaf)] + (
        [FLAT_ALIASES[leaf]] if leaf in FLAT_ALIASES else [])))
    if not close:
        candidates = [p for p in PATHS if p.startswith(section + ".")] if section else [
            *FLAT_ALIASES, *PATHS]
        close = difflib.get_close_matches(key, candidates, n=1)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return ConfigError(f"unknown config key {key!r} in {where}{hint}")


def resolve_key(key: str, where: str) -> str:
    """The dotted path a key names (itself, or the path of a flat alias); dashes are
    underscores. Raises ConfigError for an unknown key."""
    key = key.replace("-", "_")
    if key in _HINTS:
        return key
    if key in FLAT_ALIASES:
        return FLAT_ALIASES[key]
    raise _unknown_key(key, where)


def _is_section_mapping(key: str, value: Any) -> bool:
    """Whether ``key: value`` is a section written as a mapping. ``reward: {pickscore: 1.0}`` (a
    mix, the flat alias) is not: the reward section's mapping has only the section's keys."""
    if key not in SECTIONS or not isinstance(value, Mapping):
        return False
    if key != "reward":
        return True
    return all(f"reward.{str(k).replace('-', '_')}" in _HINTS for k in value)


def _canonical(data: Mapping[str, Any], where: str,
               once: bool = False) -> dict[str, tuple[str, Any]]:
    """{dotted path: (the key as written, value)} of a flat, dotted or nested mapping; a later
    key for the same path wins, or with ``once`` (a YAML file) is a ConfigError."""
    out: dict[str, tuple[str, Any]] = {}

    forms: dict[str, str] = {}  # path -> how it was written, for the message

    def put(path: str, written: str, value: Any, form: str) -> None:
        if once and path in out:
            raise ConfigError(f"{path} is given twice in {where} (as {forms[path]} and as "
                              f"{form}); give it once")
        out[path], forms[path] = (written, value), form

    for key, value in data.items():
        key = str(key).replace("-", "_")
        if _is_section_mapping(key, value):
            for leaf, leaf_value in value.items():
                written = f"{key}.{str(leaf).replace('-', '_')}"
                put(_resolve_key_in_section(written, where), written, leaf_value,
                    f"{leaf!r} under {key!r}")
        elif key in SECTIONS and key not in FLAT_ALIASES:
            if value is None:  # `optim:` with nothing under it
                continue
            raise ConfigError(f"{key} in {where} is a section: give it a mapping such as "
                              f"`{key}: {{{_first_leaf(key)}: ...}}` or a dotted key "
                              f"`{key}.{_first_leaf(key)}`, not {value!r}")
        else:
            put(resolve_key(key, where), key, value, repr(key))
    return out


def _resolve_key_in_section(path: str, where: str) -> str:
    """A ``section.key`` written under a section mapping: only that section's keys."""
    if path not in _HINTS:
        raise _unknown_key(path, where)
    return path


def _first_leaf(section: str) -> str:
    return next(p for p in PATHS if p.startswith(section + ".")).split(".")[1]


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(the non-None type, whether None is allowed) of a field's annotation."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def coerce(path: str, value: Any, name: str | None = None) -> Any:
    """Convert a YAML or command-line value to the type of the field at ``path``, or raise
    ConfigError naming it ``name`` (default: the path)."""
    name = name or path
    typ, nullable = _base_type(_HINTS[path])
    # "none" is a value of some string fields (parallel.mode: none), not null for them.
    null_words = ("null",) if typ is str else ("null", "none")
    if value is None or (isinstance(value, str) and value.lower() in null_words):
        if nullable:
            return None
        raise ConfigError(f"{name} cannot be null")
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if typ is str:
            if path in ("reward.name", "eval.guard_reward") and isinstance(value, dict):
                # {pickscore: 1.0, clip: 0.5}
                return format_reward_spec(parse_reward_spec(value))
            if isinstance(value, list):  # YAML `chunks: [2, 3, 4, 7]`
                return ",".join(str(v) for v in value)
            if isinstance(value, dict):
                raise ValueError(value)
            return str(value)
        if typing.get_origin(typ) is list:
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            return [str(v) for v in value]
    except RewardSpecError as err:
        raise ConfigError(f"{name}: {err}") from None
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"{name} expects {getattr(typ, '__name__', typ)}, got {value!r}")


def flat_keys(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A flat, dotted or nested mapping keyed by the flat alias of each setting (for code that
    keeps override dicts by those names, e.g. the ablation's); a setting added since the flat
    names keeps its dotted path."""
    flat_of = {path: flat for flat, path in FLAT_ALIASES.items()}
    return {flat_of.get(path, path): value
            for path, (_, value) in _canonical(data, where).items()}


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
                 overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the YAML file, then overrides (keys flat, dotted or nested); validated."""
    cfg, names = TrainConfig(), {}
    for where, data in ((str(yaml_path), load_yaml(yaml_path) if yaml_path else {}),
                        ("the overrides", overrides or {})):
        for path, (name, value) in _canonical(data, where, once=bool(yaml_path)
                                              and where == str(yaml_path)).items():
            section, leaf = path.split(".")
            setattr(getattr(cfg, section), leaf, coerce(path, value, name))
            names[path] = name
    return cfg.validate(names)


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """The nested form (one mapping per section); `build_config` reads it back."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def load_saved_config(path: str | Path) -> TrainConfig:
    """A run's config.yaml, nested or the flat form of earlier versions."""
    return build_config(path)


# ----------------------------------------------------------------------------- flags

def parse_args(argv: list[str] | None = None, prog: str = "python -m chunk_grpo.train",
               *, trust_flag: bool = False) -> tuple:
    """Parse ``python -m chunk_grpo.train`` arguments: (YAML path, overrides, resume dir), and
    with ``trust_flag`` a fourth value, whether --trust-checkpoint was given. The overrides are
    keyed as written (``optim.lr`` or its alias ``lr``) for the messages; a setting given under
    two names is an error."""
    parser = OneLineArgumentParser(
        prog=prog, allow_abbrev=False,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(
            prog, max_help_position=46, width=100),
        usage="%(prog)s [--config YAML | --resume DIR] [--section.key VALUE ...]",
        description="Chunk-GRPO fine-tuning of a flow-matching text-to-image model. With no "
                    "arguments:\nthe embedded tiny FLUX on JPEG compressibility, held to the "
                    "prompt by shapes-clip (CPU).\n\n"
                    "Every setting is --section.key VALUE (or --section.key=VALUE), listed by "
                    "section below;\nthe flat names of earlier versions (--lr, --group-size) "
                    "are aliases, shown beside each.")
    parser.add_argument("--config", metavar="YAML",
                        help="YAML preset, e.g. configs/flux_dev_hpsv3.yaml")
    parser.add_argument("--resume", metavar="DIR",
                        help="run directory to continue (its saved config is the base; flags "
                             "given here override it)")
    parser.add_argument("--verbose", action="store_true",
                        help="show third-party warnings and progress bars (hidden by default)")
    if trust_flag:
        parser.add_argument("--trust-checkpoint", action="store_true",
                            help="resume from a checkpoint without a manifest.json (one you "
                                 "trust; still read as tensors and plain values only)")
    alias_of = {path: flat for flat, path in FLAT_ALIASES.items()}
    defaults = TrainConfig()
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section}", (cls.__doc__ or "").strip())
        for path in (p for p in PATHS if p.startswith(section + ".")):
            alias = alias_of.get(path)  # settings added since the flat names have none
            choices = f"{'|'.join(CHOICES[path])}, " if path in CHOICES else ""
            shown = f" (alias --{alias.replace('_', '-')})" if alias else ""
            group.add_argument(f"--{path}", dest=path, default=argparse.SUPPRESS, metavar="V",
                               help=f"{choices}default {defaults.get(path)!r}{shown}")
            _add_hidden(parser, path, [f"--{path.replace('_', '-')}"])
            if alias:
                _add_hidden(parser, alias, [f"--{alias.replace('_', '-')}", f"--{alias}"])
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        key = unknown[0].lstrip("-").split("=")[0].replace("-", "_")
        raise _unknown_key(key, "the command line")
    overrides = {k: v for k, v in vars(args).items()
                 if k not in ("config", "resume", "verbose", "trust_checkpoint")}
    given: dict[str, str] = {}
    for key in overrides:
        path = resolve_key(key, "the command line")
        if path in given:
            raise ConfigError(f"{path} is given twice on the command line (as "
                              f"--{given[path]} and --{key}); give it once")
        given[path] = key
    if args.config and args.resume:
        raise ConfigError("give either --config or --resume: a resumed run uses its saved config")
    if trust_flag:
        return args.config, overrides, args.resume, args.trust_checkpoint
    return args.config, overrides, args.resume


def _add_hidden(parser: argparse.ArgumentParser, dest: str, flags: list[str]) -> None:
    """Extra spellings of a flag, accepted but not listed in --help."""
    new = [f for f in dict.fromkeys(flags) if f not in parser._option_string_actions]
    if new:
        parser.add_argument(*new, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
