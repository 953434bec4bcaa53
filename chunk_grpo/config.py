"""The training configuration: one dataclass, YAML presets, command-line overrides.

Precedence: dataclass defaults < YAML file (``--config``) < command-line flags. Every field is a
flag (``--group-size 8`` or ``--group_size 8``); unknown keys in a YAML file or on the command line
are errors that suggest the closest valid name.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from chunk_grpo.cli_args import OneLineArgumentParser, quiet_third_party
from chunk_grpo.reward_spec import RewardSpecError, format_reward_spec, parse_reward_spec


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it and the fix."""


class RunInterrupted(RuntimeError):
    """Ctrl-C stopped a run; the message names the checkpoint to resume from."""


def run_command(main: Callable[[], object], prog: str,
                errors: tuple[type[Exception], ...] | Callable[[], tuple] = ()) -> None:
    """Run a command-line entry point: a ConfigError (or one of ``errors``, e.g. a model that
    cannot be loaded) prints one line and exits with status 2, as argparse does for bad flags,
    instead of a traceback (its message already says the fix). Ctrl-C prints one line and exits
    with status 130, the shell's convention for SIGINT. ``errors`` may be a function returning
    the classes, imported only when an error happens (they live in heavy modules)."""
    try:
        main()
    except (KeyboardInterrupt, RunInterrupted) as err:
        why = _one_line(err) if isinstance(err, RunInterrupted) else "interrupted (Ctrl-C)"
        sys.stderr.write(f"{prog}: {why}\n")
        raise SystemExit(130) from None
    except Exception as err:
        kinds = errors() if callable(errors) else errors
        if not isinstance(err, (ConfigError, *kinds)):
            raise
        sys.stderr.write(f"{prog}: error: {_one_line(err)}\n")
        raise SystemExit(2) from None


def _one_line(err: BaseException) -> str:
    """The error's message on one line (some messages carry a hint on a second line)."""
    return " ".join(str(err).split("\n"))


def run_cli(main: Callable[[], object], module: str) -> None:
    """The ``__main__`` of ``python -m module``: `run_command` with every error a command reports
    in one line (a bad configuration or input file, a model or reward that cannot be loaded, an
    unknown reward, a bad reward spec or output, a damaged checkpoint, a locked run directory,
    a full disk)."""
    quiet_third_party("--verbose" in sys.argv[1:])

    run_command(main, f"python -m {module}", errors=_loaded_one_line_errors)


# Errors reported in one line besides ConfigError, by module: looked up only among the modules
# already imported (an error can only come from a loaded module), so that reporting a bad flag
# never imports diffusers.
_ONE_LINE_ERRORS = (
    ("chunk_grpo.models.loading", "ModelLoadError"),
    ("chunk_grpo.rewards.registry", "UnknownRewardError"),
    ("chunk_grpo.rewards.registry", "RewardLoadError"),
    ("chunk_grpo.reward_spec", "RewardSpecError"),
    ("chunk_grpo.rewards.outputs", "RewardError"),
    ("chunk_grpo.checkpoint", "CheckpointError"),
    ("chunk_grpo.checkpoint", "DiskFullError"),
    ("chunk_grpo.run_lock", "RunLockedError"),
)


def _loaded_one_line_errors() -> tuple[type[Exception], ...]:
    return tuple(getattr(sys.modules[module], name) for module, name in _ONE_LINE_ERRORS
                 if module in sys.modules)


@dataclass
class TrainConfig:
    # --- model, data, reward -------------------------------------------------------------
    model: str = "embedded"  # diffusers directory or hub id; "embedded" = shipped tiny FLUX
    # a registered name, module:name, remote:URL, or a mix "a=1.0,b=0.5"
    reward: str = "jpeg_compressibility"
    mix_advantage: str = "total"  # total (of the weighted sum) | per_reward (each normalised)
    reward_device: str = ""  # "" = the trainer's device; rewards get bf16 on CUDA, fp32 on CPU
    reward_batch_size: int = 0  # images per reward call; 0 = a whole rollout batch
    reward_overlap: bool = True  # score rollout batch i while batch i+1 is sampled
    train_prompts: str = "shapes:rl"  # a prompt file, or shapes:rl / shapes:train / shapes:heldout
    eval_prompts: str = "shapes:heldout"
    output_dir: str = ""  # "" = runs/<timestamp>
    seed: int = 0
    height: int | None = None  # None = the model's default size
    width: int | None = None

    # --- algorithm ----------------------------------------------------------------------
    algorithm: str = "chunk_grpo"  # chunk_grpo | g2rpo (singular branch step, several finishes)
    g2rpo_granularities: str = "1,2"  # g2rpo: ODE strides of the finishes after the branch

    # --- sampling (rollouts) ----------------------------------------------------------
    num_steps: int = 10  # T: sampling steps in training; the last transition is not trained
    shift: float = 3.0
    dynamic_shift: bool = False  # FLUX's resolution-dependent shift from the token count instead
    sde_kind: str = "flow"  # flow | dance | cps | cps_mse
    eta: float = 0.7
    cfg_scale: float | None = None  # None = the model's default_cfg_scale
    group_size: int = 8  # G images per prompt
    prompts_per_step: int = 8  # prompts per rank per iteration
    shared_noise: bool = True  # same initial noise for the whole group
    antithetic_noise: bool = False  # image pairs in a group draw opposite noise (even G)
    sde_window: int = 3  # k > 0: only the first k steps are SDE (and trained), the rest ODE
    decode: str = "final"  # final latent | x0 (the last step's clean prediction)
    rollout_batch_size: int = 64  # rows per rollout transformer call

    # --- chunking -------------------------------------------------------------------------
    chunks: str = "auto"  # "2,3,4,7" | "auto" | "step" | "sequence"
    chunk_size: int | None = None  # fixed-size chunks; overrides `chunks`
    chunk_fraction: float = 1.0  # fraction of chunks trained per iteration
    weighted_chunks: bool = False  # draw chunks with weight ~ mean relative change
    profile_prompts: int = 16  # prompts used for the temporal-dynamics profile
    max_chunk_size: int = 5  # auto chunking splits longer segments

    # --- loss -----------------------------------------------------------------------------
    adv_norm: str = "group"  # group | global | none
    adv_clip_max: float | None = 5.0
    adv_eps: float = 1e-4
    clip_low: float = 1e-3  # ratios of mean-reduced step log-probs stay within ~1e-3
    clip_high: float = 1e-3
    kl_coef: float = 0.0
    kl_ref: str = "old"  # old (k3 vs the rollout policy) | reference (LoRA disabled)

    # --- optimisation ---------------------------------------------------------------------
    max_steps: int = 400  # training iterations (rollout + update)
    max_minutes: float = 10.0  # stop after this much training wall time (0 = no limit)
    micro_batch_size: int = 8  # samples per training call (call batch = chunk size x this)
    grad_accum: int = 0  # training calls per optimizer step (0 = all of an iteration)
    ppo_epochs: int = 1  # passes over each batch of rollouts
    optimizer: str = "adamw"  # adamw | adamw8bit
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_steps: int = 0  # optimizer steps of linear warm-up
    lr_schedule: str = "constant"  # constant | cosine
    mixed_precision: str = "auto"  # auto (bf16 where native, else fp32) | no | bf16
    gradient_checkpointing: bool = False
    lora_rank: int = 8  # 0 = full fine-tuning
    lora_alpha: float | None = None  # None = lora_rank
    lora_targets: list[str] = field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"]
    )
    ema_decay: float = 0.0  # 0 = no EMA
    attention_backend: str = "auto"  # auto (flash if installed, else native) | native | flash
    guidance: float | None = None  # FLUX.1-dev's distilled guidance; None = the model's default

    # --- scale: memory and parallelism ------------------------------------------------------
    parallelism: str = "ddp"  # ddp | fsdp (FSDP2, a shard per transformer block) | none
    cpu_offload: bool = False  # fsdp: keep parameters, gradients and optimizer state on the CPU
    compile_blocks: bool = False  # torch.compile each transformer block
    weights_dtype: str = "auto"  # frozen weights and the base: auto (bf16 on CUDA, else fp32)
    text_encoders: str = "keep"  # keep (on the device) | cache (embed once, free them) | cpu
    prompt_cache_dir: str = ""  # text_encoders: cache; "" = ~/.cache/chunk_grpo/prompt_embeds

    # --- evaluation, logging, checkpoints, faults ------------------------------------------
    eval_every: int = 50  # iterations between evaluations (0 = only at the end)
    eval_images: int = 32  # held-out images per periodic evaluation
    final_eval_images: int = 256  # held-out images of the final evaluation (the run's summary)
    eval_hybrid_steps: int = 8  # >0: also evaluate hybrid inference, this many policy steps
    log_every: int = 1
    image_grid_every: int = 25  # iterations between rollout image grids (0 = never)
    checkpoint_every: int = 25  # iterations between checkpoints (0 = only at the end)
    keep_checkpoints: int = 2
    max_bad_steps: int = 3  # consecutive non-finite steps before the run stops
    device: str = "auto"  # auto | cpu | cuda
    progress: bool = True

    @property
    def num_trained(self) -> int:
        """W: the transitions with a log-prob, which the chunks split."""
        from chunk_grpo.chunking import trained_transitions  # needs torch: see validate()

        return trained_transitions(self.num_steps, self.sde_window)

    def validate(self) -> TrainConfig:
        """Raise ConfigError for any inconsistent value; returns self."""
        _choice("algorithm", self.algorithm, ("chunk_grpo", "g2rpo"))
        _choice("sde_kind", self.sde_kind, ("flow", "dance", "cps", "cps_mse"))
        _choice("decode", self.decode, ("final", "x0"))
        _choice("adv_norm", self.adv_norm, ("group", "global", "none"))
        _choice("mix_advantage", self.mix_advantage, ("total", "per_reward"))
        _choice("kl_ref", self.kl_ref, ("old", "reference"))
        _choice("optimizer", self.optimizer, ("adamw", "adamw8bit"))
        _choice("lr_schedule", self.lr_schedule, ("constant", "cosine"))
        _choice("mixed_precision", self.mixed_precision, ("auto", "no", "bf16"))
        _choice("attention_backend", self.attention_backend, ("auto", "native", "flash"))
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        _choice("parallelism", self.parallelism, ("ddp", "fsdp", "none"))
        _choice("weights_dtype", self.weights_dtype, ("auto", "fp32", "bf16"))
        _choice("text_encoders", self.text_encoders, ("keep", "cache", "cpu"))
        for name in ("num_steps", "group_size", "prompts_per_step", "rollout_batch_size",
                     "micro_batch_size", "ppo_epochs", "profile_prompts", "max_chunk_size",
                     "eval_images", "final_eval_images", "log_every", "keep_checkpoints",
                     "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "grad_accum", "warmup_steps", "eval_every", "checkpoint_every",
                     "image_grid_every", "lora_rank", "eval_hybrid_steps", "sde_window",
                     "reward_batch_size"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_steps < 2:
            raise ConfigError(f"num_steps must be >= 2 (the last step is not trained), "
                              f"got {self.num_steps}")
        if self.group_size < 2 and self.adv_norm != "none":
            raise ConfigError("group_size must be >= 2 for group advantages; "
                              "set adv_norm: none for single samples")
        if self.antithetic_noise and self.group_size % 2:
            raise ConfigError(f"antithetic_noise pairs the images of a group: group_size must be "
                              f"even, got {self.group_size}")
        if not 0.0 < self.chunk_fraction <= 1.0:
            raise ConfigError(f"chunk_fraction must be in (0, 1], got {self.chunk_fraction}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ConfigError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if not (0.0 <= self.eta):
            raise ConfigError(f"eta must be >= 0, got {self.eta}")
        if self.eta == 0.0:
            raise ConfigError("eta must be > 0 for training: an SDE step with no noise has "
                              "no log-probability")
        if self.clip_low < 0 or self.clip_high < 0 or self.clip_low >= 1:
            raise ConfigError(f"clip_low must be in [0, 1) and clip_high >= 0, got "
                              f"{self.clip_low}, {self.clip_high}")
        if self.adv_clip_max is not None and self.adv_clip_max <= 0:
            raise ConfigError(f"adv_clip_max must be > 0 or null, got {self.adv_clip_max}")
        self._check_numbers()
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.kl_ref == "reference" and self.kl_coef > 0 and self.lora_rank == 0:
            raise ConfigError("kl_ref: reference needs LoRA (lora_rank > 0): the reference "
                              "model is the base with the adapters disabled")
        if self.max_minutes < 0:
            raise ConfigError("max_minutes must be >= 0")
        # Imported here, not at the top: the commands parse their flags before torch loads
        # (chunk_grpo.cli_args), and these modules need torch.
        from chunk_grpo.branching import GranularityError, parse_granularities
        from chunk_grpo.chunking import ChunkSpecError, parse_chunk_spec

        try:
            parse_reward_spec(self.reward)
        except RewardSpecError as err:
            raise ConfigError(f"reward: {err}") from None
        if not re.fullmatch(r"|cpu|cuda(:\d+)?", self.reward_device):
            raise ConfigError(f"reward_device must be '' (the trainer's device), cpu, cuda or "
                              f"cuda:N; got {self.reward_device!r}")
        try:
            parse_chunk_spec(self.chunks, self.num_trained, self.chunk_size)
        except ChunkSpecError as err:
            raise ConfigError(f"chunks: {err}") from None
        try:
            parse_granularities(self.g2rpo_granularities)
        except GranularityError as err:
            raise ConfigError(f"g2rpo_granularities: {err}") from None
        if self.algorithm == "g2rpo" and not self.shared_noise:
            raise ConfigError("algorithm g2rpo branches one ODE trajectory per prompt, so the "
                              "group shares its initial noise: set shared_noise: true")
        return self

    def _check_numbers(self) -> None:
        """Every float finite (``lr: nan`` or ``--lr inf`` would train NaN weights), and each in
        its range."""
        for name, value in dataclasses.asdict(self).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value}")
        positive = ("lr", "max_grad_norm", "adam_eps", "adv_eps", "shift", "lora_alpha")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        for name in ("weight_decay", "kl_coef", "cfg_scale", "guidance"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None and value < 16:
                raise ConfigError(f"{name} must be >= 16 pixels or null (the model's size), "
                                  f"got {value}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


def _unknown_key(key: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(_FIELDS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r} in {where}{hint}")


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(the non-None type, whether None is allowed) of a field's annotation."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def coerce(key: str, value: Any) -> Any:
    """Convert a YAML or command-line value to the field's type, or raise ConfigError."""
    if key not in _FIELDS:
        raise _unknown_key(key, "the configuration")
    typ, nullable = _base_type(_HINTS[key])
    # "none" is a value of some string fields (parallelism: none), not null for them.
    null_words = ("null",) if typ is str else ("null", "none")
    if value is None or (isinstance(value, str) and value.lower() in null_words):
        if nullable:
            return None
        raise ConfigError(f"{key} cannot be null")
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
            if key == "reward" and isinstance(value, dict):  # YAML {pickscore: 1.0, clip: 0.5}
                return format_reward_spec(parse_reward_spec(value))
            if isinstance(value, list):  # YAML `chunks: [2, 3, 4, 7]`
                return ",".join(str(v) for v in value)
            return str(value)
        if typing.get_origin(typ) is list:
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            return [str(v) for v in value]
    except RewardSpecError as err:
        raise ConfigError(f"{key}: {err}") from None
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"{key} expects {getattr(typ, '__name__', typ)}, got {value!r}")


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping; a missing, undecodable or malformed file is a ConfigError naming the file
    (and the line)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
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
                 overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the YAML file, then overrides; validated."""
    values: dict[str, Any] = {}
    for source, data in ((str(yaml_path), load_yaml(yaml_path) if yaml_path else {}),
                         ("the overrides", overrides or {})):
        for key, value in data.items():
            key = key.replace("-", "_")
            if key not in _FIELDS:
                raise _unknown_key(key, source)
            values[key] = coerce(key, value)
    return TrainConfig(**values).validate()


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def load_saved_config(path: str | Path) -> TrainConfig:
    return build_config(path)


def parse_args(argv: list[str] | None = None, prog: str = "python -m chunk_grpo.train"
               ) -> tuple[str | None, dict[str, Any], str | None]:
    """Parse ``python -m chunk_grpo.train`` arguments: (YAML path, overrides, resume dir)."""
    parser = OneLineArgumentParser(
        prog=prog, allow_abbrev=False,
        description="Chunk-GRPO fine-tuning of a flow-matching text-to-image model. With no "
                    "arguments: the embedded tiny FLUX on the shapes reward (CPU).")
    parser.add_argument("--config", help="YAML preset, e.g. configs/flux_dev_hpsv3.yaml")
    parser.add_argument("--resume", metavar="DIR",
                        help="run directory to continue (its saved config is the base; flags "
                             "given here override it)")
    parser.add_argument("--verbose", action="store_true",
                        help="show third-party warnings and progress bars (hidden by default)")
    for name, f in _FIELDS.items():
        flag = "--" + name.replace("_", "-")
        aliases = [flag] if "_" not in name else [flag, "--" + name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        parser.add_argument(*aliases, dest=name, default=argparse.SUPPRESS, metavar="VALUE",
                            help=f"default: {default!r}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        key = unknown[0].lstrip("-").split("=")[0].replace("-", "_")
        raise _unknown_key(key, "the command line")
    overrides = {k: v for k, v in vars(args).items()
                 if k not in ("config", "resume", "verbose")}
    if args.config and args.resume:
        raise ConfigError("give either --config or --resume: a resumed run uses its saved config")
    return args.config, overrides, args.resume
