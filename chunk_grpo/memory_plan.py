"""The memory plan: bytes per GPU of every part of a training run, before any GPU is touched.

`plan_for_config(cfg, world_size, gpu_bytes)` sizes the run from the configuration: the models'
parameter counts from their real configs on the meta device (`chunk_grpo.plan_models`), the
transformer's activations measured with FakeTensor (`chunk_grpo.plan_activations`), and the
arithmetic below. `check_plan` raises `PlanDoesNotFit` (a ConfigError: one line with the peak,
the budget and the levers that would cut it, by effect) when the peak exceeds the budget.

The arithmetic, per GPU (shard = world size under FSDP, else 1):
- trainable weights: fp32 master, 4 B/param / shard; gradients: 4 B/param / shard;
  AdamW: 8 B/param / shard (adamw8bit: 2 B + 2 fp32 scales per 256 values); EMA: 4 B/param;
  with ``cpu_offload`` (FSDP) these live on the CPU;
- frozen weights (LoRA's base) and the hybrid-evaluation base in ``weights_dtype``, sharded the
  same way under FSDP. With LoRA the base *is* the frozen weights with the adapters disabled (0
  extra); with full fine-tuning it is one frozen copy;
- FSDP's working set: the two largest blocks unsharded in the compute dtype (the one computing
  and the one prefetched), one block's unsharded gradient (compute dtype + the fp32 copy reduced),
  and the unsharded root (embedders, final norm);
- DDP: its gradient buckets, a second copy of the gradients (torch's default,
  ``gradient_as_bucket_view=False``);
- text encoders (``keep``) and VAE in ``weights_dtype``; the reward models in bf16 on CUDA;
- activations: the peak of one training call (its trained steps x micro-batch rows; the largest
  draw of chunks)
  and of one rollout call with the VAE decode of its batch, measured with FakeTensor; under bf16
  autocast the casts of fp32 weights autocast keeps are part of it;
- a fixed allowance for the CUDA context, cuBLAS/NCCL workspaces and allocator slack.
The peak is the static parts plus the larger of the training phase and the rollout phase.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from chunk_grpo.chunking import parse_chunk_spec
from chunk_grpo.cli_args import EMBEDDED_MODEL_DIR
from chunk_grpo.config import ConfigError, TrainConfig
from chunk_grpo.models.sampling_defaults import CONFIG_NAME, SamplingDefaults
from chunk_grpo.plan_activations import (
    Adapters,
    CallMemory,
    CallPrecision,
    CallShape,
    estimate_flux_call,
    estimate_vae_decode,
)
from chunk_grpo.plan_models import (
    ModelConfigs,
    build_clip_text,
    build_t5_encoder,
    build_transformer,
    build_vae,
    count_parameters,
    lora_parameter_count,
    resolve_model_configs,
    reward_parameter_counts,
    transformer_blocks,
)
from chunk_grpo.precision import resolve_mixed_precision

GB = 1e9
CUDA_CONTEXT_BYTES = 3 * 10**9  # CUDA context (~0.5-1 GB), cuBLAS/NCCL workspaces, allocator slack
ADAM8BIT_BYTES = 2 + 2 * 4 / 256  # two uint8 states, one fp32 scale per 256 values each
LORA_LEVER_RANK = 64
_DTYPE_BYTES = {"fp32": 4, "bf16": 2}
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class PlanDoesNotFit(ConfigError):
    """The configuration's memory plan exceeds the GPU memory; the message names the levers."""


@dataclass(frozen=True)
class PlanSettings:
    """Everything the plan depends on, as plain values (resolved from a TrainConfig)."""

    model: str
    reward: str
    height: int
    width: int
    text_tokens: int
    device: str  # "cuda" | "cpu": where the run trains
    world_size: int
    parallelism: str  # fsdp | ddp | none
    cpu_offload: bool
    lora_rank: int
    lora_targets: tuple[str, ...]
    optimizer: str
    compute_dtype: str  # "bf16" (autocast) | "fp32"
    weights_dtype: str  # frozen weights, base, text encoders, VAE: "bf16" | "fp32"
    gradient_checkpointing: bool
    micro_batch_size: int
    max_chunk: int  # steps of the largest training call (its chunks): max_chunk x micro rows
    rollout_batch_size: int
    rollout_rows: int  # rows sampled per rank and iteration (prompts x group)
    num_steps: int
    text_encoders: str  # keep | cache | cpu
    hybrid_base: bool  # eval_hybrid_steps > 0
    ema: bool
    reward_gb: float | None = None  # the reward models' size when they are not known by name

    @property
    def shard(self) -> int:
        return self.world_size if self.parallelism == "fsdp" else 1

    @property
    def train_rows(self) -> int:
        return self.max_chunk * self.micro_batch_size


@dataclass(frozen=True)
class PlanRow:
    part: str
    gpu_bytes: float
    where: str = "GPU"
    note: str = ""
    phase: str = "static"  # static | train | rollout


@dataclass
class Plan:
    """The plan's rows, its peak per GPU, the budget and the assumptions it made."""

    settings: PlanSettings
    rows: list[PlanRow]
    gpu_bytes: float
    assumptions: list[str] = field(default_factory=list)
    source: str = ""

    def phase_bytes(self, phase: str) -> float:
        return sum(r.gpu_bytes for r in self.rows if r.phase == phase)

    @property
    def peak_bytes(self) -> float:
        return self.phase_bytes("static") + max(self.phase_bytes("train"),
                                                self.phase_bytes("rollout"))

    @property
    def peak_phase(self) -> str:
        return "training" if self.phase_bytes("train") >= self.phase_bytes("rollout") \
            else "rollout"

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.gpu_bytes

    @property
    def margin_bytes(self) -> float:
        return self.gpu_bytes - self.peak_bytes

    def verdict(self) -> str:
        word = "fits" if self.fits else "does not fit"
        sign = "margin" if self.fits else "short by"
        return (f"{word}: peak {self.peak_bytes / GB:.1f} GB per GPU ({self.peak_phase} phase) of "
                f"{self.gpu_bytes / GB:.1f} GB, {sign} {abs(self.margin_bytes) / GB:.1f} GB")

    def to_dict(self) -> dict:
        return {
            "settings": dataclasses.asdict(self.settings),
            "source": self.source,
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "static_bytes": self.phase_bytes("static"),
            "train_bytes": self.phase_bytes("train"),
            "rollout_bytes": self.phase_bytes("rollout"),
            "peak_bytes": self.peak_bytes,
            "gpu_bytes": self.gpu_bytes,
            "fits": self.fits,
            "margin_bytes": self.margin_bytes,
            "assumptions": self.assumptions,
        }


# ----------------------------------------------------------------------------- settings

def _resolved_size(cfg: TrainConfig) -> tuple[int, int, int]:
    """(height, width, T5 tokens): the config's size, else the model's chunk_grpo.json; the
    prompt length from chunk_grpo.json (FLUX.1-dev: 512)."""
    name = cfg.model.name
    local = Path(str(EMBEDDED_MODEL_DIR) if name == "embedded" else name).expanduser()
    found = local.is_dir() and (local / CONFIG_NAME).is_file()
    defaults = SamplingDefaults.load(local) if found else SamplingDefaults()
    if (cfg.model.height is None or cfg.model.width is None) and not found:
        raise ConfigError(f"model {name} has no {CONFIG_NAME}, so the plan needs the image "
                          f"size: set height and width (e.g. --height 720 --width 720)")
    return (cfg.model.height or defaults.height, cfg.model.width or defaults.width,
            defaults.max_sequence_length)


def _steps_per_call(cfg: TrainConfig) -> int:
    """Trained steps of the largest training call. A micro-batch trains all the chunks drawn
    for the iteration in one call, so: the largest ``round(fraction x K)`` chunks together
    (G2RPO: its one step; ``auto``, whose layout is measured at start: every trained step, a
    bound)."""
    if cfg.sampling.algorithm == "g2rpo":
        return 1
    layout = parse_chunk_spec(cfg.chunks.spec, cfg.num_trained, cfg.chunks.size)
    if layout is None:
        return cfg.num_trained
    drawn = max(1, min(layout.num_chunks, round(cfg.chunks.fraction * layout.num_chunks)))
    return sum(sorted(layout.sizes, reverse=True)[:drawn])


def settings_from_config(cfg: TrainConfig, world_size: int, device: str | None = None,
                         reward_gb: float | None = None) -> PlanSettings:
    """The plan's inputs from a training config on ``world_size`` ranks. ``device`` (default:
    the config's; "auto" plans for CUDA) picks the dtypes: on CUDA ``auto`` means bf16 autocast
    and bf16 frozen weights; on the CPU, what the trainer picks on this machine."""
    device = device or cfg.run.device
    device = "cuda" if device == "auto" else device
    if device == "cuda":
        compute = "fp32" if cfg.model.mixed_precision == "no" else "bf16"
    else:
        mode = resolve_mixed_precision(cfg.model.mixed_precision, "cpu").mode
        compute = "bf16" if mode == "bf16" else "fp32"
    weights = cfg.model.weights_dtype if cfg.model.weights_dtype != "auto" else (
        "bf16" if device == "cuda" else "fp32")
    height, width, text_tokens = _resolved_size(cfg)
    rows = cfg.sampling.prompts_per_step * cfg.sampling.group_size
    return PlanSettings(
        model=cfg.model.name, reward=cfg.reward.name, height=height, width=width,
        text_tokens=text_tokens,
        device=device, world_size=world_size, parallelism=cfg.parallel.mode,
        cpu_offload=cfg.parallel.cpu_offload, lora_rank=cfg.model.lora_rank,
        lora_targets=tuple(cfg.model.lora_targets), optimizer=cfg.optim.name, compute_dtype=compute,
        weights_dtype=weights, gradient_checkpointing=cfg.model.gradient_checkpointing,
        micro_batch_size=cfg.optim.micro_batch_size, max_chunk=_steps_per_call(cfg),
        rollout_batch_size=min(cfg.sampling.batch_size, rows),
        rollout_rows=rows, num_steps=cfg.sampling.steps,
        text_encoders=cfg.model.text_encoders, hybrid_base=cfg.eval.hybrid_steps > 0,
        ema=cfg.optim.ema_decay > 0, reward_gb=reward_gb)


# ----------------------------------------------------------------------------- sizes

@dataclass(frozen=True)
class ModelSizes:
    """Parameter counts of the pipeline's parts (from their configs, on meta)."""

    transformer: int
    largest_block: int
    root: int  # outside the blocks: embedders, final norm and projection
    vae: int
    text_encoders: int
    configs: ModelConfigs


@functools.lru_cache(maxsize=8)
def model_sizes(model: str) -> ModelSizes:
    configs = resolve_model_configs(model)
    transformer = build_transformer(configs.transformer)
    blocks = [count_parameters(b) for b in transformer_blocks(transformer)]
    total = count_parameters(transformer)
    return ModelSizes(
        transformer=total, largest_block=max(blocks), root=total - sum(blocks),
        vae=count_parameters(build_vae(configs.vae)),
        text_encoders=count_parameters(build_clip_text(configs.text_encoder))
        + count_parameters(build_t5_encoder(configs.text_encoder_2)),
        configs=configs)


@functools.lru_cache(maxsize=8)
def _lora_parameters(model: str, rank: int, targets: tuple[str, ...]) -> int:
    transformer = build_transformer(model_sizes(model).configs.transformer)
    try:
        return lora_parameter_count(transformer, rank, list(targets))
    except ValueError as err:
        raise ConfigError(f"lora_targets: {err}") from None


@functools.lru_cache(maxsize=8)
def _reward_sizes(spec: str):
    return tuple(reward_parameter_counts(spec))


# ----------------------------------------------------------------------------- activations

def _call_precision(s: PlanSettings) -> CallPrecision:
    """The weights' dtypes inside a call: FSDP2's mixed precision hands every block its
    unsharded weights in the compute dtype; DDP/none keep fp32 trainable weights (autocast
    casts them) and the frozen ones in weights_dtype."""
    autocast = torch.bfloat16 if s.compute_dtype == "bf16" else None
    if s.parallelism == "fsdp":
        compute = _TORCH_DTYPES[s.compute_dtype]
        return CallPrecision(trainable=compute, frozen=compute, autocast=autocast)
    return CallPrecision(trainable=torch.float32, frozen=_TORCH_DTYPES[s.weights_dtype],
                         autocast=autocast)


@functools.lru_cache(maxsize=64)
def _call_memory(model: str, shape: CallShape, train: bool, gradient_checkpointing: bool,
                 adapters: Adapters, precision: CallPrecision) -> CallMemory:
    return estimate_flux_call(model_sizes(model).configs.transformer, shape, train=train,
                              gradient_checkpointing=gradient_checkpointing, adapters=adapters,
                              precision=precision)


@functools.lru_cache(maxsize=16)
def _decode_memory(model: str, batch: int, height: int, width: int, dtype: str) -> CallMemory:
    return estimate_vae_decode(model_sizes(model).configs.vae, batch, height, width,
                               _TORCH_DTYPES[dtype])


def image_tokens(s: PlanSettings, configs: ModelConfigs) -> int:
    factor = 2 ** (len(configs.vae["block_out_channels"]) - 1) * 2  # VAE, then 2x2 patches
    return (s.height // factor) * (s.width // factor)


# ----------------------------------------------------------------------------- the plan

def build_plan(s: PlanSettings, gpu_bytes: float) -> Plan:
    """The memory plan of ``s`` against ``gpu_bytes`` per GPU."""
    sizes = model_sizes(s.model)
    cuda = s.device == "cuda"
    lora = s.lora_rank > 0
    shard, fsdp = s.shard, s.parallelism == "fsdp"
    trainable = _lora_parameters(s.model, s.lora_rank, s.lora_targets) if lora \
        else sizes.transformer
    wbytes, cbytes = _DTYPE_BYTES[s.weights_dtype], _DTYPE_BYTES[s.compute_dtype]
    offload = fsdp and s.cpu_offload
    device = "GPU" if cuda else "CPU"
    home = "CPU" if offload else device
    split = f"/{shard} (FSDP shard)" if fsdp else "full copy"
    rows: list[PlanRow] = []

    def add(part: str, nbytes: float, note: str = "", phase: str = "static",
            where: str = device) -> None:
        if where != device:  # offloaded from the GPU to the host
            note = f"{nbytes / GB:.1f} GB on the CPU per rank; {note}".rstrip("; ")
            nbytes = 0.0
        rows.append(PlanRow(part, nbytes, where, note, phase))

    what = f"LoRA r={s.lora_rank} ({trainable / 1e6:.1f}M)" if lora else \
        f"full FT ({trainable / 1e9:.2f}B)"
    add("trainable weights (fp32 master)", 4 * trainable / shard, f"{what}, {split}",
        where=home)
    opt_bytes = 8 if s.optimizer == "adamw" else ADAM8BIT_BYTES
    add(f"optimizer state ({s.optimizer})", opt_bytes * trainable / shard,
        f"{opt_bytes:.2f} B/param, {split}", where=home)
    if s.ema:
        add("EMA of the trainable weights", 4 * trainable / shard, f"fp32, {split}")
    frozen = sizes.transformer if lora else 0
    add(f"frozen weights ({s.weights_dtype})", wbytes * frozen / shard,
        "the base under LoRA" if lora else "none: every weight is trained",
        where=home if frozen else device)
    if not s.hybrid_base:
        add("hybrid-evaluation base", 0, "eval_hybrid_steps: 0")
    elif lora:
        add("hybrid-evaluation base", 0, "the same weights with the adapters disabled")
    else:
        add(f"hybrid-evaluation base ({s.weights_dtype})", wbytes * sizes.transformer / shard,
            f"one frozen copy, {split}")
    text_bytes = wbytes * sizes.text_encoders
    text_note = f"T5 + CLIP, {sizes.text_encoders / 1e9:.2f}B in {s.weights_dtype}"
    if s.text_encoders == "cache":
        add("text encoders", 0, "text_encoders: cache (embeddings on disk, encoders freed)")
    else:
        add("text encoders", text_bytes, text_note,
            where="CPU" if s.text_encoders == "cpu" else device)
    add(f"VAE ({s.weights_dtype})", wbytes * sizes.vae, f"{sizes.vae / 1e6:.1f}M params")
    add_reward(add, s, cuda)
    add("CUDA context, workspaces, allocator slack", CUDA_CONTEXT_BYTES if cuda else 0,
        "fixed allowance" if cuda else "none on the CPU")
    tokens = image_tokens(s, sizes.configs)
    channels = sizes.configs.transformer["in_channels"]
    latents = s.rollout_rows * (s.num_steps + 1) * tokens * channels * 4
    images = s.rollout_rows * 3 * s.height * s.width * 4
    add("rollout buffers", latents + images,
        f"{s.rollout_rows} rows x {s.num_steps + 1} latents fp32 + decoded images")

    # The training phase: gradients, FSDP's or DDP's working set, the call's activations.
    add("gradients (fp32)", 4 * trainable / shard, split, phase="train", where=home)
    if fsdp:
        working = 2 * cbytes * sizes.largest_block + cbytes * sizes.root
        grads = (cbytes + 4) * (sizes.largest_block if not lora else 0)
        add("FSDP unsharded blocks", working + grads,
            f"2 blocks + root in {s.compute_dtype}"
            + ("" if lora else ", 1 block's gradient (+ fp32 for the reduce)"), phase="train")
    elif s.parallelism == "ddp" and s.world_size > 1:
        add("DDP gradient buckets", 4 * trainable, "a copy of the gradients", phase="train")
    adapters = Adapters(s.lora_rank, s.lora_targets) if lora else Adapters()
    precision = _call_precision(s)
    train_shape = CallShape(s.train_rows, tokens, s.text_tokens)
    train = _call_memory(s.model, train_shape, True, s.gradient_checkpointing, adapters,
                         precision)
    checkpointing = "with" if s.gradient_checkpointing else "without"
    copies = f", incl. {train.weight_copies / GB:.1f} GB autocast weight casts" \
        if train.weight_copies else ""
    add("activations (training call)", train.peak,
        f"{s.train_rows} rows = {s.max_chunk} trained steps x micro-batch {s.micro_batch_size}, "
        f"{tokens}+{s.text_tokens} tokens, {checkpointing} checkpointing; saved for backward "
        f"{train.saved / GB:.2f} GB{copies}", phase="train")

    # The rollout phase: a no-grad call of a rollout batch, then the VAE decode of it.
    if fsdp:
        add("FSDP unsharded blocks", 2 * cbytes * sizes.largest_block + cbytes * sizes.root,
            f"2 blocks + root in {s.compute_dtype}", phase="rollout")
    roll = _call_memory(s.model, CallShape(s.rollout_batch_size, tokens, s.text_tokens), False,
                        False, adapters, precision)
    decode = _decode_memory(s.model, s.rollout_batch_size, s.height, s.width, s.weights_dtype)
    add("activations (rollout call, VAE decode)", max(roll.peak, decode.peak),
        f"{s.rollout_batch_size} rows, no grad: transformer {roll.peak / GB:.2f} GB, "
        f"decode {decode.peak / GB:.2f} GB", phase="rollout")

    assumptions = [
        f"parallelism {s.parallelism} on {s.world_size} {'GPU' if cuda else 'process'}(es); "
        f"compute {s.compute_dtype}"
        + (" (bf16 autocast, simulated with CPU autocast)" if s.compute_dtype == "bf16" else "")
        + f"; frozen weights, base, encoders and VAE in {s.weights_dtype}",
        "hybrid-evaluation base: " + ("none" if not s.hybrid_base else
                                      "LoRA disabled on the same weights (0 extra)" if lora else
                                      "one frozen copy of the transformer"),
        f"activations measured with FakeTensor at {s.height}x{s.width} ({tokens} image tokens, "
        f"{s.text_tokens} text tokens) and extrapolated from 1-2 blocks of each kind",
        "reward scoring's own activations are not measured (no-grad, one reward batch)",
    ]
    if cuda:
        assumptions.append(f"CUDA context/workspace allowance {CUDA_CONTEXT_BYTES / GB:.0f} GB")
    if offload:
        assumptions.append("cpu_offload: weights, gradients and optimizer state on the CPU")
    return Plan(settings=s, rows=rows, gpu_bytes=gpu_bytes, assumptions=assumptions,
                source=sizes.configs.source)


def add_reward(add, s: PlanSettings, cuda: bool) -> None:
    """The reward models' row: bf16 on CUDA, fp32 on the CPU; unknown ones from --reward-gb."""
    sizes = _reward_sizes(s.reward)
    known = sum(r.parameters for r in sizes if r.parameters is not None)
    unknown = [r.name for r in sizes if r.parameters is None]
    what = ", ".join(f"{r.name}: {r.what}" for r in sizes)
    nbytes = (2 if cuda else 4) * known
    if unknown:
        if s.reward_gb is None:
            raise ConfigError(f"the size of reward {', '.join(unknown)} is unknown to the plan; "
                              f"give it with --reward-gb GB (its weights on one GPU)")
        nbytes += s.reward_gb * GB
        what += f"; {s.reward_gb:g} GB given by --reward-gb"
    add(f"reward model ({'bf16' if cuda else 'fp32'})", nbytes,
        f"{what} ({known / 1e9:.2f}B params)")


# ----------------------------------------------------------------------------- levers

def _levers(s: PlanSettings) -> list[tuple[str, PlanSettings]]:
    """The changes that cut memory, each as (its config line, the changed settings)."""
    out = []
    if s.parallelism != "fsdp" and s.world_size > 1:
        out.append(("parallelism: fsdp", dataclasses.replace(s, parallelism="fsdp")))
    if s.lora_rank == 0:
        out.append((f"lora_rank: {LORA_LEVER_RANK}", dataclasses.replace(
            s, lora_rank=LORA_LEVER_RANK,
            lora_targets=s.lora_targets or ("to_q", "to_k", "to_v", "to_out.0"))))
    if s.optimizer == "adamw":
        out.append(("optimizer: adamw8bit", dataclasses.replace(s, optimizer="adamw8bit")))
    if not s.gradient_checkpointing:
        out.append(("gradient_checkpointing: true",
                    dataclasses.replace(s, gradient_checkpointing=True)))
    if s.micro_batch_size > 1:
        half = s.micro_batch_size // 2
        out.append((f"micro_batch_size: {half}", dataclasses.replace(s, micro_batch_size=half)))
    if s.text_encoders == "keep":
        out.append(("text_encoders: cache", dataclasses.replace(s, text_encoders="cache")))
    if s.weights_dtype == "fp32" and s.device == "cuda":
        out.append(("weights_dtype: bf16", dataclasses.replace(s, weights_dtype="bf16")))
    if s.parallelism == "fsdp" and not s.cpu_offload:
        out.append(("cpu_offload: true", dataclasses.replace(s, cpu_offload=True)))
    return out


def levers_by_effect(plan: Plan) -> list[tuple[str, float]]:
    """(lever, bytes it saves at the peak), largest first; levers that save nothing dropped."""
    effects = []
    for label, changed in _levers(plan.settings):
        saved = plan.peak_bytes - build_plan(changed, plan.gpu_bytes).peak_bytes
        if saved > 0:
            effects.append((label, saved))
    return sorted(effects, key=lambda item: -item[1])


def does_not_fit_message(plan: Plan) -> str:
    s = plan.settings
    levers = levers_by_effect(plan)
    cuts = ", ".join(f"{label} (-{saved / GB:.1f} GB)" for label, saved in levers) or \
        "none left: use more or larger GPUs"
    return (f"memory plan: peak {plan.peak_bytes / GB:.1f} GB per GPU exceeds the "
            f"{plan.gpu_bytes / GB:.1f} GB budget ({s.world_size} x {s.device}, parallelism "
            f"{s.parallelism}, lora_rank {s.lora_rank}); levers by effect: {cuts}. Run python "
            f"-m chunk_grpo.plan for the table")


def plan_for_config(cfg: TrainConfig, world_size: int, gpu_bytes: float, *,
                    device: str | None = None, reward_gb: float | None = None) -> Plan:
    """The memory plan of a training config on ``world_size`` devices of ``gpu_bytes``."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if not math.isfinite(gpu_bytes) or gpu_bytes <= 0:
        raise ConfigError(f"GPU memory must be > 0, got {gpu_bytes}")
    try:
        settings = settings_from_config(cfg, world_size, device, reward_gb)
        return build_plan(settings, gpu_bytes)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err)) from None


def check_plan(cfg: TrainConfig, world_size: int, gpu_bytes: float, *,
               reward_gb: float | None = None) -> Plan:
    """The trainer's start-up check on CUDA: the plan, or `PlanDoesNotFit` with the peak, the
    budget and the levers that would cut it, in order of effect."""
    plan = plan_for_config(cfg, world_size, gpu_bytes, device="cuda", reward_gb=reward_gb)
    if not plan.fits:
        raise PlanDoesNotFit(does_not_fit_message(plan))
    return plan


def format_plan(plan: Plan) -> str:
    """The table (parts x GB per GPU and where), the phases, the assumptions and the verdict."""
    s = plan.settings
    lines = [f"Memory plan: {s.model} with reward {s.reward}, {s.world_size} x "
             f"{plan.gpu_bytes / GB:.0f} GB ({s.device}), parallelism {s.parallelism}"
             f"{' + cpu_offload' if s.cpu_offload and s.parallelism == 'fsdp' else ''}, "
             f"{'LoRA r=' + str(s.lora_rank) if s.lora_rank else 'full fine-tuning'}, "
             f"{s.optimizer}",
             f"model configs: {plan.source}", ""]
    width = max(len(r.part) for r in plan.rows) + 2
    lines.append(f"{'part':<{width}}{'GB/GPU':>8}  {'phase':<8} {'where':<5} note")
    lines.append("-" * (width + 60))
    for r in plan.rows:
        lines.append(f"{r.part:<{width}}{r.gpu_bytes / GB:>8.2f}  {r.phase:<8} {r.where:<5} "
                     f"{r.note}")
    lines.append("-" * (width + 60))
    for phase, label in (("static", "static (all phases)"), ("train", "training phase adds"),
                         ("rollout", "rollout phase adds")):
        lines.append(f"{label:<{width}}{plan.phase_bytes(phase) / GB:>8.2f}")
    lines.append(f"{'peak':<{width}}{plan.peak_bytes / GB:>8.2f}  ({plan.peak_phase})")
    lines.append("")
    lines.extend(f"assumes: {a}" for a in plan.assumptions)
    lines.append("")
    lines.append(plan.verdict())
    return "\n".join(lines)
