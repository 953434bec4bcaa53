"""The training configuration: one dataclass per section, each checking itself.

A setting is named by its dotted path, ``section.key``: ``--optim.lr 1e-4`` on the command line,
``optim: {lr: 1e-4}`` in YAML. Choices are ``Literal`` types; each section checks its values in
``__post_init__`` and `TrainConfig` checks the rules across sections, so every way of building a
config (YAML, flags, `with_changes`, the constructor) gives a checked one. Reading YAML and flags
into these classes is `chunk_grpo.config.parsing`'s job.

Torch-free: every command parses and checks its flags before it loads a model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from chunk_grpo.config.checks import (
    check_across_sections,
    check_image_size,
    check_reward_device,
    check_reward_spec,
    check_section,
    key_paths,
    section_names,
)
from chunk_grpo.config.decoding import merge_overrides
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.sampling_options import DecodeTarget, SDEKind, check_antithetic
from chunk_grpo.config.specs import (
    GranularityError,
    export_formats,
    lora_target_modules,
    parse_granularities,
    trained_transitions,
)

REPORT_TO = ("tensorboard", "jsonl", "wandb")  # run.report_to: the logging backends


@dataclass
class ModelConfig:
    """The policy: which model, its size, precision and what is trained."""

    name: str = "embedded"  # diffusers directory or hub id; "embedded" = shipped tiny FLUX
    height: int | None = None  # None = the model's default size
    width: int | None = None
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"  # auto: bf16 where native, else fp32
    # frozen weights and the base: auto (bf16 on CUDA, else fp32)
    weights_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    attention_backend: Literal["auto", "native", "flash"] = "auto"  # auto: flash if installed
    gradient_checkpointing: bool = False
    compile_blocks: bool = False  # torch.compile each transformer block
    lora_rank: int = 8  # 0 = full fine-tuning
    lora_alpha: float | None = None  # None = lora_rank
    # LoRA's frozen base in 4 or 8 bits (QLoRA, bitsandbytes; chunk_grpo.models.quantize)
    base_quantization: Literal["none", "nf4", "int8"] = "none"
    # a preset (attention | attention+text | all: chunk_grpo.config.specs.LORA_PRESETS)
    # or module names
    lora_targets: list[str] = field(default_factory=lambda: ["attention+text"])
    guidance: float | None = None  # FLUX.1-dev's distilled guidance; None = the model's default
    # keep (on the device) | cache (embed once, free them) | cpu
    text_encoders: Literal["keep", "cache", "cpu"] = "keep"
    prompt_cache_dir: str = ""  # text_encoders: cache; "" = ~/.cache/chunk_grpo/prompt_embeds
    tf32: bool = True  # CUDA fp32 matmuls and convolutions in TF32 (no effect on the CPU)

    def __post_init__(self) -> None:
        check_section(self, "model", at_least={"lora_rank": 0}, positive=("lora_alpha",),
                      non_negative=("guidance",))
        check_image_size(self, "model")
        if self.lora_rank > 0:  # a preset name, or module names (not both)
            try:
                lora_target_modules(self.lora_targets)
            except ValueError as err:
                raise ConfigError(f"model.{err}") from None


@dataclass
class RewardConfig:
    """What the images are scored with."""

    # a registered name, module:name, remote:URL, or a mix "a=1.0,b=0.5"
    # The embedded default: DDPO's JPEG compressibility, held to the prompt by a tenth of the
    # shapes world's learned CLIP score (alone, JPEG learns empty canvases: docs/results)
    name: str = "jpeg_compressibility=1,shapes-clip=0.1"
    # total (of the weighted sum) | per_reward (each normalised)
    mix_advantage: Literal["total", "per_reward"] = "total"
    device: str = ""  # "" = the trainer's device; rewards get bf16 on CUDA, fp32 on CPU
    batch_size: int = 0  # images per reward call; 0 = a whole rollout batch
    overlap: bool = True  # score rollout batch i while batch i+1 is sampled
    timeout: float = 0.0  # seconds a rollout batch's reward call may take; 0 = no limit

    def __post_init__(self) -> None:
        check_section(self, "reward", at_least={"batch_size": 0}, non_negative=("timeout",))
        check_reward_spec("reward.name", self.name)
        check_reward_device("reward.device", self.device, "the trainer's device")


@dataclass
class DataConfig:
    """The prompt sets."""

    train_prompts: str = "shapes:rl"  # a prompt file, or shapes:rl / shapes:train / shapes:heldout
    eval_prompts: str = "shapes:heldout"


@dataclass
class SamplingConfig:
    """The rollouts: the algorithm, the sampler and the groups."""

    # chunk_grpo | g2rpo (singular branch step, several finishes)
    algorithm: Literal["chunk_grpo", "g2rpo"] = "chunk_grpo"
    g2rpo_granularities: str = "1,2"  # g2rpo: ODE strides of the finishes after the branch
    steps: int = 10  # T: sampling steps in training; the last transition is not trained
    shift: float = 3.0
    dynamic_shift: bool = False  # FLUX's resolution-dependent shift from the token count instead
    sde: SDEKind = "flow"  # the stochastic sampler
    eta: float = 0.7
    cfg_scale: float | None = None  # None = the model's default_cfg_scale
    group_size: int = 8  # G images per prompt
    prompts_per_step: int = 8  # prompts per rank per iteration
    shared_noise: bool = True  # same initial noise for the whole group
    antithetic_noise: bool = False  # image pairs in a group draw opposite noise (even G)
    sde_window: int = 6  # k > 0: only the first k steps are SDE (and trained), the rest ODE
    decode: DecodeTarget = "final"  # final latent | x0 (last step's clean prediction)
    batch_size: int = 64  # rows per rollout transformer call

    def __post_init__(self) -> None:
        check_section(self, "sampling", at_least={
            "steps": 1, "group_size": 1, "prompts_per_step": 1, "batch_size": 1,
            "sde_window": 0}, positive=("shift",), non_negative=("cfg_scale", "eta"))
        if self.steps < 2:
            raise ConfigError(f"sampling.steps must be >= 2 (the last step is not trained), got "
                              f"{self.steps}")
        if self.sde_window > self.steps:
            raise ConfigError(f"sampling.sde_window {self.sde_window} is beyond the {self.steps} "
                              f"sampling steps (sampling.steps); give at most {self.steps - 1} "
                              "(the last step is never trained), or 0 for every step")
        if self.eta == 0.0:
            raise ConfigError("sampling.eta must be > 0 for training: an SDE step with no noise "
                              "has no log-probability")
        check_antithetic(self.antithetic_noise, self.group_size, error=ConfigError)
        try:
            parse_granularities(self.g2rpo_granularities)
        except GranularityError as err:
            raise ConfigError(f"sampling.g2rpo_granularities: {err}") from None
        if self.algorithm == "g2rpo" and not self.shared_noise:
            raise ConfigError("sampling.algorithm g2rpo branches one ODE trajectory per prompt, "
                              "so the group shares its initial noise: set "
                              "sampling.shared_noise: true")


@dataclass
class ChunksConfig:
    """How the trained transitions are split into chunks, and which are trained."""

    spec: str = "auto"  # "2,3,4,7" | "auto" | "step" | "sequence"
    size: int | None = None  # fixed-size chunks; overrides `spec`
    fraction: float = 0.5  # fraction of chunks trained per iteration
    weighted: bool = False  # draw chunks with weight ~ mean relative change
    profile_prompts: int = 16  # prompts used for the temporal-dynamics profile
    max_size: int = 5  # auto chunking splits longer segments

    def __post_init__(self) -> None:
        check_section(self, "chunks", at_least={"size": 1, "profile_prompts": 1, "max_size": 1})
        if self.size is not None and self.spec not in ("auto", "step"):
            raise ConfigError(f"chunks.spec {self.spec!r} and chunks.size {self.size} both set "
                              "the chunk layout; give one of them")
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"chunks.fraction must be in (0, 1], got {self.fraction}")


@dataclass
class LossConfig:
    """Advantages, the clipped ratio and the KL term."""

    adv_norm: Literal["group", "global", "none"] = "group"
    adv_clip_max: float | None = 5.0
    adv_eps: float = 1e-4
    clip_low: float = 1e-3  # ratios of mean-reduced step log-probs stay within ~1e-3
    clip_high: float = 1e-3
    kl_coef: float = 0.0
    # old (k3 vs the rollout policy) | reference (the base model)
    kl_ref: Literal["old", "reference"] = "old"

    def __post_init__(self) -> None:
        check_section(self, "loss", positive=("adv_eps", "adv_clip_max"),
                      non_negative=("kl_coef", "clip_high"), unit_interval=("clip_low",))


@dataclass
class OptimConfig:
    """The optimizer, its schedule, and how the batch is split into optimizer steps."""

    name: Literal["adamw", "adamw8bit"] = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_steps: int = 0  # optimizer steps of linear warm-up
    schedule: Literal["constant", "cosine"] = "constant"
    micro_batch_size: int = 8  # rows per training call (call batch = trained steps x this)
    grad_accum: int = 0  # micro-batches per optimizer step (0 = all of an iteration)
    ppo_epochs: int = 1  # passes over each batch of rollouts
    ema_decay: float = 0.0  # 0 = no EMA

    def __post_init__(self) -> None:
        check_section(self, "optim", at_least={"warmup_steps": 0, "micro_batch_size": 1,
                                               "grad_accum": 0, "ppo_epochs": 1},
                      positive=("lr", "eps", "max_grad_norm"), non_negative=("weight_decay",),
                      unit_interval=("beta1", "beta2", "ema_decay"))


@dataclass
class ParallelConfig:
    """Several processes (torchrun) and memory."""

    mode: Literal["ddp", "fsdp", "none"] = "ddp"  # fsdp: FSDP2, a shard per transformer block
    cpu_offload: bool = False  # fsdp: keep parameters, gradients and optimizer state on the CPU
    # fsdp: the dtype gradients are reduce-scattered in
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # how long a collective may wait for the other ranks (start-up encodes prompts, loads and
    # profiles the model while they wait) before the job fails
    timeout_minutes: float = 60.0

    def __post_init__(self) -> None:
        check_section(self, "parallel")
        if self.reduce_dtype != "fp32" and self.mode != "fsdp":
            raise ConfigError(f"parallel.reduce_dtype {self.reduce_dtype} needs parallel.mode: "
                              "fsdp (ddp all-reduces fp32 gradients); set it to fp32 or use fsdp")
        if not self.timeout_minutes > 0:
            raise ConfigError(f"parallel.timeout_minutes must be > 0 minutes (how long ranks "
                              f"wait for each other), got {self.timeout_minutes}; e.g. 60")


@dataclass
class EvalConfig:
    """The held-out evaluations."""

    every: int = 50  # iterations between evaluations (0 = only at the end)
    images: int = 32  # held-out images per periodic evaluation
    final_images: int = 256  # held-out images of the final evaluation (the run's summary)
    hybrid_steps: int = 8  # >0: also evaluate hybrid inference, this many policy steps
    # a second reward scored beside the trained one (rollouts, evaluations, summary): a reward
    # spec as --reward.name takes it; auto = the shapes checks on shapes: prompts; none = off
    guard_reward: str = "auto"
    # stop when a periodic evaluation's paired guard change lies below -guard_stop with its
    # whole 95% CI (0 = never stop)
    guard_stop: float = 0.0

    def __post_init__(self) -> None:
        check_section(self, "eval", at_least={"every": 0, "images": 1, "final_images": 1,
                                              "hybrid_steps": 0}, non_negative=("guard_stop",))
        if self.guard_reward.strip().lower() not in ("auto", "none"):
            check_reward_spec("eval.guard_reward", self.guard_reward,
                              " (or auto, or none for no guard)")


@dataclass
class RunConfig:
    """The run: where, how long, logging, checkpoints and faults."""

    output_dir: str = ""  # "" = runs/<timestamp>
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
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

    def __post_init__(self) -> None:
        check_section(self, "run", at_least={
            "max_steps": 0, "log_every": 1, "image_grid_every": 0, "checkpoint_every": 0,
            "keep_checkpoints": 1, "max_bad_steps": 1}, non_negative=("max_minutes",))
        try:
            export_formats(self.export, lora=True)  # the names; lora needs a LoRA run: below
        except ValueError as err:
            raise ConfigError(str(err)) from None
        unknown = [b for b in self.report_to if b not in REPORT_TO]
        if unknown:
            raise ConfigError(f"run.report_to: {unknown[0]!r} is not a logging backend; give any "
                              f"of {', '.join(REPORT_TO)}")
        if "wandb" in self.report_to and importlib.util.find_spec("wandb") is None:
            raise ConfigError("run.report_to: wandb is not installed; pip install "
                              "'chunk-grpo[wandb]' (or wandb>=0.17), or drop wandb from "
                              "run.report_to")


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

    def __post_init__(self) -> None:
        check_across_sections(self)

    @property
    def num_trained(self) -> int:
        """W: the transitions with a log-prob, which the chunks split."""
        return trained_transitions(self.sampling.steps, self.sampling.sde_window)

    def get(self, path: str) -> Any:
        """The value at a dotted path (``"optim.lr"``)."""
        section, _, key = path.partition(".")
        return getattr(getattr(self, section), key)

    def with_changes(self, changes: Mapping[str, Any]) -> TrainConfig:
        """A checked copy with ``changes`` ({dotted path: value}, values as in YAML) applied."""
        return merge_overrides(self, (changes, "the changes"))

    def validate(self) -> TrainConfig:
        """Check every section and the rules across them again (after fields were assigned);
        raise ConfigError naming the first bad key; return self."""
        for f in dataclasses.fields(self):
            check = getattr(getattr(self, f.name), "__post_init__", None)
            if check is not None:
                check()
        self.__post_init__()
        return self

    def to_dict(self) -> dict[str, Any]:
        """{section: {key: value}}: the form config.yaml is saved in."""
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = section_names(TrainConfig)
# Every key's dotted path, in the order of the sections and their fields.
PATHS: tuple[str, ...] = key_paths(TrainConfig)
