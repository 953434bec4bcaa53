"""The memory plan: bytes per GPU and per host of every phase of a training run, before any GPU
is touched.

`plan_for_config(cfg, world_size, gpu_bytes)` sizes the run from the configuration: the models'
parameter counts from their real configs on the meta device (`chunk_grpo.plan.models`), the
transformer's activations measured with FakeTensor (`chunk_grpo.plan.activations`), and the
arithmetic below. The run's peak is that of its largest phase; `check_plan` (the trainer's
start-up check) raises `PlanDoesNotFit` (a ConfigError: one line with the phase, its peak, the
budget and the levers that would cut it, by effect) when a phase exceeds the budget.

The parts, per GPU (shard S = world size under FSDP, else 1; P transformer parameters, T of
them trained):
- trainable weights: fp32 master, 4T/S; AdamW 8T/S (adamw8bit: 2 B + 2 fp32 scales per 256
  values) from the first step on; EMA 4T/S; with ``cpu_offload`` (FSDP) these live on the CPU;
- frozen weights (LoRA's base) and the hybrid-evaluation base in ``weights_dtype``, sharded the
  same way under FSDP (LoRA's base *is* the frozen weights with the adapters disabled);
- gradients: under FSDP each rank holds only its fp32 shards, 4T/S, across the micro-batches of
  an accumulation (they are reduce-scattered every micro-batch), plus FSDP's working set of one
  unsharded block's gradient in the compute dtype and its reduce-scatter copy in
  ``reduce_dtype``; under DDP a full gradient copy (4T) and its buckets (another 4T);
- FSDP2's working set in the compute dtype: in a forward the root (embedders, final norm), the
  previous group's all-gather buffer (kept until the next copy-out) and a block's buffer and
  unsharded copy; in the backward the root, a block and the next one prefetched;
- text encoders and VAE in ``weights_dtype``; the reward models in bf16 on CUDA;
- activations of one call (a training micro-batch: its trained steps x micro-batch rows, forward
  and backward; a no-grad sampling batch and the VAE decode of it), measured with FakeTensor;
- a fixed allowance for the CUDA context, cuBLAS/NCCL workspaces and allocator slack; on a CPU
  run, for what the process grows by above its post-import memory from the first iteration on
  (kernel code, lazily imported modules, small objects).

The phases, in the order a run meets them: load (the policy built on meta, sharded, and each
rank filling its shards from the checkpoint, its rows of one tensor at a time; then the hybrid
base from the shards and the reward), prompt caching (``text_encoders: cache``: the encoders
on the GPU while encoding, then freed), the temporal profile (no-grad forwards of the sharded
model), rollout, reward, training with accumulation, evaluation (no-grad sampling, the hybrid base),
checkpoint save and export. Host memory is per node (``gpus_per_node`` ranks): the checkpoint
files' page cache once per node (every rank maps the same files), plus what each rank holds on
its CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from chunk_grpo.algorithm.chunking import parse_chunk_spec
from chunk_grpo.config.cli_args import EMBEDDED_MODEL_DIR
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.schema import TrainConfig
from chunk_grpo.models.sampling_defaults import CONFIG_NAME, SamplingDefaults
from chunk_grpo.plan.activations import (
    Adapters,
    CallMemory,
    CallPrecision,
    CallShape,
    bound_flux_call,
    bound_vae_decode,
    estimate_flux_call,
    estimate_vae_decode,
)
from chunk_grpo.plan.models import (
    ModelConfigs,
    build_clip_text,
    build_t5_encoder,
    build_transformer,
    build_vae,
    count_parameters,
    largest_lora_tensor,
    largest_tensor,
    lora_parameter_count,
    resolve_model_configs,
    reward_parameter_counts,
    transformer_blocks,
)
from chunk_grpo.plan.quantized import dequantized_bytes, quantized_base_bytes, quantized_layers
from chunk_grpo.runtime.precision import resolve_mixed_precision

GB = 1e9
CUDA_CONTEXT_BYTES = 3 * 10**9  # CUDA context (~0.5-1 GB), cuBLAS/NCCL workspaces, allocator slack
# A CPU run's process grows above its post-import baseline as it meets its calls, whatever the
# model's size: the code pages of the kernels it executes, modules imported on first use, and
# native allocations outside tensors. Measured on the FLUX-shaped QLoRA CPU run
# (benchmarks/bench_plan_quantized.py): 0.02 GB after the load, 0.1 GB from the first training
# step on (0.04 GB of library code, mostly torch's CPU kernels; 0.01 GB of Python objects;
# 0.05 GB of other native memory). On CUDA this is host memory, outside the GPU's bytes.
CPU_RUNTIME_BYTES = 10**8
ADAM8BIT_BYTES = 2 + 2 * 4 / 256  # two uint8 states, one fp32 scale per 256 values each
LORA_LEVER_RANK = 64
PROMPT_CACHE_BATCH = 16  # prompts per text-encoder call (`prompt_cache.build_prompt_cache`)
CHECKPOINT_BYTES_PER_PARAM = 2  # FLUX.1-dev and its encoders ship bf16 safetensors
PHASES = ("load", "prompt_cache", "profile", "rollout", "reward", "train", "eval", "checkpoint",
          "export")
REDUCE_DTYPES = ("fp32", "bf16")
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
    reduce_dtype: str = "fp32"  # FSDP's gradient reduce-scatter dtype
    gpus_per_node: int = 0  # 0: min(world size, 8)
    profile_rows: int = 0  # prompts of the temporal profile per batch (0: no profile)
    reward_batch: int = 0  # images per reward call (0: a rollout batch)
    eval_rows: int = 0  # evaluation images per rank
    base_quantization: str = "none"  # LoRA's frozen base: none | nf4 | int8 (bitsandbytes)
    # "measured" (FakeTensor, seconds) | "bound" (analytic lower bounds, for start-up checks)
    activations: str = "measured"

    @property
    def shard(self) -> int:
        return self.world_size if self.parallelism == "fsdp" else 1

    @property
    def train_rows(self) -> int:
        return self.max_chunk * self.micro_batch_size

    @property
    def ranks_per_node(self) -> int:
        return min(self.world_size, self.gpus_per_node or 8)


@dataclass(frozen=True)
class PlanRow:
    """One part of the run: its bytes per GPU (0 when it lives elsewhere) and where."""

    part: str
    gpu_bytes: float
    where: str = "GPU"
    note: str = ""


@dataclass(frozen=True)
class PhasePlan:
    """One phase's peak: the parts on each GPU, and on each host (per node: the page cache
    once, each rank's own CPU memory times the ranks of a node). ``host_rank_bytes``: the most
    one rank's process holds on its CPU (for a CPU run, what adds to its device bytes)."""

    name: str
    gpu_parts: tuple[tuple[str, float], ...]
    host_parts: tuple[tuple[str, float], ...] = ()
    host_rank_bytes: float = 0.0
    note: str = ""
    process_peak: float = 0.0  # a step of the phase whose CPU-run peak exceeds the sum (load)

    @property
    def gpu_bytes(self) -> float:
        return sum(b for _, b in self.gpu_parts)

    @property
    def process_bytes(self) -> float:
        """One rank's process at the phase's peak when the device and the host are one memory
        (a CPU run): its device and host bytes, or a step with more (the load's fill, with the
        checkpoint rows the rank maps)."""
        return max(self.process_peak, self.gpu_bytes + self.host_rank_bytes)

    @property
    def host_bytes(self) -> float:
        return sum(b for _, b in self.host_parts)

    def to_dict(self) -> dict:
        return {"name": self.name, "gpu_bytes": self.gpu_bytes, "host_bytes": self.host_bytes,
                "host_rank_bytes": self.host_rank_bytes, "process_bytes": self.process_bytes,
                "note": self.note,
                "gpu_parts": dict(self.gpu_parts), "host_parts": dict(self.host_parts)}


@dataclass
class Plan:
    """The plan's parts, its phases, the budget and the assumptions it made."""

    settings: PlanSettings
    rows: list[PlanRow]
    phases: list[PhasePlan]
    gpu_bytes: float
    assumptions: list[str] = field(default_factory=list)
    source: str = ""
    train_by_reduce_dtype: dict[str, float] = field(default_factory=dict)

    def phase(self, name: str) -> PhasePlan:
        return next(p for p in self.phases if p.name == name)

    @property
    def peak_phase(self) -> str:
        """The phase with the largest GPU peak (the first of equals)."""
        return max(self.phases, key=lambda p: p.gpu_bytes).name

    @property
    def peak_bytes(self) -> float:
        return self.phase(self.peak_phase).gpu_bytes

    @property
    def host_peak_bytes(self) -> float:
        return max(p.host_bytes for p in self.phases)

    @property
    def host_peak_phase(self) -> str:
        return max(self.phases, key=lambda p: p.host_bytes).name

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
                f"{self.gpu_bytes / GB:.1f} GB, {sign} {abs(self.margin_bytes) / GB:.1f} GB; "
                f"host peak {self.host_peak_bytes / GB:.1f} GB per node "
                f"({self.host_peak_phase} phase)")

    def to_dict(self) -> dict:
        return {
            "settings": dataclasses.asdict(self.settings),
            "source": self.source,
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "phases": [p.to_dict() for p in self.phases],
            "peak_phase": self.peak_phase,
            "peak_bytes": self.peak_bytes,
            "host_peak_phase": self.host_peak_phase,
            "host_peak_bytes": self.host_peak_bytes,
            "train_by_reduce_dtype": self.train_by_reduce_dtype,
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
                          f"size: set model.height and model.width (e.g. --model.height 720 "
                          "--model.width 720)")
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


def _profile_rows(cfg: TrainConfig) -> int:
    """Prompts per batch of the temporal-dynamics profile (0 when the run does not profile:
    G2RPO, or fixed unweighted chunks)."""
    if cfg.sampling.algorithm == "g2rpo":
        return 0
    layout = parse_chunk_spec(cfg.chunks.spec, cfg.num_trained, cfg.chunks.size)
    if layout is not None and not cfg.chunks.weighted:
        return 0
    return min(cfg.sampling.batch_size, cfg.chunks.profile_prompts)


def settings_from_config(cfg: TrainConfig, world_size: int, device: str | None = None,
                         reward_gb: float | None = None,
                         gpus_per_node: int | None = None) -> PlanSettings:
    """The plan's inputs from a training config on ``world_size`` ranks (``gpus_per_node`` of
    them per host; default min(world size, 8)). ``device`` (default: the config's; "auto"
    plans for CUDA) picks the dtypes: on CUDA ``auto`` means bf16 autocast and bf16 frozen
    weights; on the CPU, what the trainer picks on this machine."""
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
        ema=cfg.optim.ema_decay > 0, reward_gb=reward_gb,
        reduce_dtype=getattr(cfg.parallel, "reduce_dtype", "fp32"),
        gpus_per_node=gpus_per_node or min(world_size, 8), profile_rows=_profile_rows(cfg),
        reward_batch=min(cfg.reward.batch_size or cfg.sampling.batch_size, rows),
        eval_rows=math.ceil(max(cfg.eval.images, cfg.eval.final_images) / world_size),
        base_quantization=cfg.model.base_quantization if cfg.model.lora_rank > 0 else "none")


# ----------------------------------------------------------------------------- sizes

@dataclass(frozen=True)
class ModelSizes:
    """Parameter counts of the pipeline's parts (from their configs, on meta)."""

    transformer: int
    largest_block: int
    block_pair: int  # the two adjacent blocks with the most parameters
    root: int  # outside the blocks: embedders, final norm and projection
    blocks: tuple[int, ...]  # every block's parameters, in forward order (FSDP's units)
    largest_tensor: int  # the transformer's largest weight (loaded whole, one at a time)
    vae: int
    text_encoders: int
    configs: ModelConfigs
    files: dict  # component -> bytes of its checkpoint files


@functools.lru_cache(maxsize=8)
def model_sizes(model: str) -> ModelSizes:
    configs = resolve_model_configs(model)
    transformer = build_transformer(configs.transformer)
    blocks = [count_parameters(b) for b in transformer_blocks(transformer)]
    total = count_parameters(transformer)
    pairs = [a + b for a, b in zip(blocks, blocks[1:], strict=False)] or blocks
    vae = count_parameters(build_vae(configs.vae))
    text = count_parameters(build_clip_text(configs.text_encoder)) \
        + count_parameters(build_t5_encoder(configs.text_encoder_2))
    counts = {"transformer": total, "vae": vae, "text_encoders": text}
    return ModelSizes(
        transformer=total, largest_block=max(blocks), block_pair=max(pairs),
        root=total - sum(blocks), blocks=tuple(blocks),
        largest_tensor=largest_tensor(transformer), vae=vae,
        text_encoders=text, configs=configs,
        files={part: _checkpoint_bytes(model, part, n) for part, n in counts.items()})


def _checkpoint_bytes(model: str, part: str, parameters: int) -> int:
    """Bytes of a component's safetensors files in a local model directory, else its parameters
    at `CHECKPOINT_BYTES_PER_PARAM` (the published FLUX.1-dev files are bf16)."""
    local = Path(str(EMBEDDED_MODEL_DIR) if model == "embedded" else model).expanduser()
    folders = ("text_encoder", "text_encoder_2") if part == "text_encoders" else (part,)
    found = [f for folder in folders for f in (local / folder).glob("*.safetensors")] \
        if local.is_dir() else []
    return sum(f.stat().st_size for f in found) if found else \
        CHECKPOINT_BYTES_PER_PARAM * parameters


@functools.lru_cache(maxsize=8)
def _lora_parameters(model: str, rank: int, targets: tuple[str, ...]) -> int:
    transformer = build_transformer(model_sizes(model).configs.transformer)
    try:
        return lora_parameter_count(transformer, rank, list(targets))
    except ValueError as err:
        raise ConfigError(f"model.lora_targets: {err}") from None


@functools.lru_cache(maxsize=8)
def _largest_trained_tensor(model: str, rank: int, targets: tuple[str, ...]) -> int:
    """Elements of the largest trained tensor: an adapter's under LoRA, else the
    transformer's largest weight."""
    if rank == 0:
        return model_sizes(model).largest_tensor
    transformer = build_transformer(model_sizes(model).configs.transformer)
    return largest_lora_tensor(transformer, rank, list(targets))


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
    if s.base_quantization != "none":  # dequantized to the compute dtype, nothing cast
        return CallPrecision(trainable=torch.float32, frozen=_TORCH_DTYPES[s.compute_dtype],
                             autocast=autocast)
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


def _fsdp_forward_parameters(sizes: ModelSizes) -> int:
    """Parameters FSDP2 holds unsharded (in the compute dtype) at the peak of a forward. The
    root's stay unsharded for the whole forward. Each group's all-gather buffer outlives its
    copy-out until the next group's copy-out (FSDP2's implicit prefetch), so when block i is
    copied out, the previous group's buffer (the root's for the first block), block i's buffer
    and block i's unsharded parameters are live at once."""
    previous = (sizes.root, *sizes.blocks[:-1])
    return sizes.root + max((p + 2 * b for p, b in zip(previous, sizes.blocks, strict=True)),
                            default=sizes.root)


@dataclass(frozen=True)
class _Backward:
    unsharded: float  # bytes of unsharded parameters
    gradient: float  # bytes of the unsharded gradient and its reduce-scatter buffers


def _fsdp_backward(sizes: ModelSizes, cbytes: int, rbytes: int, shard: int,
                   lora: bool) -> _Backward:
    """FSDP2's largest backward working set: the root (unsharded since the forward), block i
    and block i-1 all-gathered ahead (backward prefetch; none before the first block: the
    root is already there), and block i's gradient, in the compute dtype while it is cast into
    the reduce-scatter input (``reduce_dtype``, unsharded), then that input and the reduced
    shard. Under LoRA the gradients in flight are the adapters' (negligible)."""
    best = _Backward(0.0, 0.0)
    for i, b in enumerate(sizes.blocks or (0,)):
        before = sizes.blocks[i - 1] if i else 0
        gradient = 0 if lora else max(cbytes + rbytes, rbytes * (1 + 1 / shard)) * b
        step = _Backward(cbytes * (sizes.root + b + before), gradient)
        if step.unsharded + step.gradient > best.unsharded + best.gradient:
            best = step
    return best
def _call_bound(model: str, shape: CallShape, train: bool, gradient_checkpointing: bool,
                adapters: Adapters, precision: CallPrecision) -> CallMemory:
    compute = 2 if precision.autocast is not None else precision.trainable.itemsize
    return bound_flux_call(model_sizes(model).configs.transformer, shape, train=train,
                           gradient_checkpointing=gradient_checkpointing, compute_bytes=compute)


def _decode_bound(model: str, batch: int, height: int, width: int, dtype: str) -> CallMemory:
    return bound_vae_decode(model_sizes(model).configs.vae, batch, height, width,
                            _DTYPE_BYTES[dtype])


def image_tokens(s: PlanSettings, configs: ModelConfigs) -> int:
    factor = 2 ** (len(configs.vae["block_out_channels"]) - 1) * 2  # VAE, then 2x2 patches
    return (s.height // factor) * (s.width // factor)


# ----------------------------------------------------------------------------- the plan

def build_plan(s: PlanSettings, gpu_bytes: float) -> Plan:
    """The memory plan of ``s`` against ``gpu_bytes`` per GPU."""
    sizes = model_sizes(s.model)
    rows, phases = _phases(s, sizes)
    train = {reduce: _phases(dataclasses.replace(s, reduce_dtype=reduce), sizes)[1][
        PHASES.index("train")].gpu_bytes for reduce in REDUCE_DTYPES}
    return Plan(settings=s, rows=rows, phases=phases, gpu_bytes=gpu_bytes,
                assumptions=_assumptions(s, sizes), source=sizes.configs.source,
                train_by_reduce_dtype=train)


def _phases(s: PlanSettings, sizes: ModelSizes) -> tuple[list[PlanRow], list[PhasePlan]]:
    """The parts (rows) and the phases built from them."""
    cuda, lora = s.device == "cuda", s.lora_rank > 0
    shard, fsdp = s.shard, s.parallelism == "fsdp"
    trainable = _lora_parameters(s.model, s.lora_rank, s.lora_targets) if lora \
        else sizes.transformer
    wbytes, cbytes = _DTYPE_BYTES[s.weights_dtype], _DTYPE_BYTES[s.compute_dtype]
    rbytes = _DTYPE_BYTES[s.reduce_dtype]
    offload = fsdp and s.cpu_offload
    device = "GPU" if cuda else "CPU"
    split = f"/{shard} (FSDP shard)" if fsdp else "full copy"
    ranks = s.ranks_per_node
    rows: list[PlanRow] = []
    host_rank: dict[str, float] = {}  # part -> bytes on each rank's CPU (cpu_offload, cpu)

    def part(name: str, nbytes: float, note: str = "", where: str = device) -> float:
        """A part's bytes on the GPU (0 when it lives on the CPU: then per rank on the host)."""
        if where != device:
            host_rank[name] = nbytes
            note = f"{nbytes / GB:.2f} GB on the CPU per rank; {note}".rstrip("; ")
            nbytes = 0.0
        rows.append(PlanRow(name, nbytes, where, note))
        return nbytes

    what = f"LoRA r={s.lora_rank} ({trainable / 1e6:.1f}M)" if lora else \
        f"full FT ({trainable / 1e9:.2f}B)"
    home = "CPU" if offload else device
    weights = part("trainable weights (fp32 master)", 4 * trainable / shard, f"{what}, {split}",
                   home)
    opt_bytes = 8 if s.optimizer == "adamw" else ADAM8BIT_BYTES
    optimizer = part(f"optimizer state ({s.optimizer})", opt_bytes * trainable / shard,
                     f"{opt_bytes:.2f} B/param, {split}, from the first step", home)
    ema = part("EMA of the trainable weights", 4 * trainable / shard if s.ema else 0,
               f"fp32, {split}" if s.ema else "optim.ema_decay: 0")
    quantized = quantized_layers(s.model) if s.base_quantization != "none" else None
    if quantized is not None:
        frozen = part(f"frozen weights ({s.base_quantization} base)",
                      quantized_base_bytes(quantized, s.base_quantization, wbytes),
                      f"{quantized.weights / 1e9:.2f}B in {s.base_quantization} (bitsandbytes), "
                      f"{(quantized.rest + quantized.biases) / 1e9:.2f}B in {s.weights_dtype}")
    else:
        frozen = part(f"frozen weights ({s.weights_dtype})",
                      wbytes * sizes.transformer / shard if lora else 0,
                      "the base under LoRA" if lora else "none: every weight is trained",
                      home if lora else device)
    dequant = part("dequantized weight in flight",
                   dequantized_bytes(quantized, cbytes) if quantized else 0,
                   f"the largest quantized layer in {s.compute_dtype}, one at a time"
                   if quantized else "no quantized base")
    if not s.hybrid_base or lora:
        base = part("hybrid-evaluation base", 0, "eval.hybrid_steps: 0" if not s.hybrid_base
                    else "the same weights with the adapters disabled")
    else:
        base = part(f"hybrid-evaluation base ({s.weights_dtype})",
                    wbytes * sizes.transformer / shard, f"one frozen copy, {split}")
    text_all = wbytes * sizes.text_encoders
    text_note = f"T5 + CLIP, {sizes.text_encoders / 1e9:.2f}B in {s.weights_dtype}"
    if s.text_encoders == "cache":
        text = part("text encoders", 0,
                    "model.text_encoders: cache (on the GPU only while caching)")
    else:
        text = part("text encoders", text_all, text_note,
                    "CPU" if s.text_encoders == "cpu" else device)
    vae = part(f"VAE ({s.weights_dtype})", wbytes * sizes.vae, f"{sizes.vae / 1e6:.1f}M params")
    reward, reward_note = _reward_bytes(s, cuda)
    reward = part(f"reward model ({'bf16' if cuda else 'fp32'})", reward, reward_note)
    context = part("CUDA context, workspaces, allocator slack", CUDA_CONTEXT_BYTES if cuda else 0,
                   "fixed allowance" if cuda else "none on the CPU")
    runtime = part("CPU runtime above the imports", 0 if cuda else CPU_RUNTIME_BYTES,
                   "a CPU run's: on CUDA it is host memory" if cuda else
                   "kernel code, lazy imports, small objects; from the first iteration on")
    tokens = image_tokens(s, sizes.configs)
    channels = sizes.configs.transformer["in_channels"]
    pixels = 3 * s.height * s.width * 4
    buffers = part("rollout buffers", s.rollout_rows * ((s.num_steps + 1) * tokens * channels * 4
                                                        + pixels),
                   f"{s.rollout_rows} rows x {s.num_steps + 1} latents fp32 + decoded images")
    if fsdp:
        gradients = part("gradients (fp32 shards)", 4 * trainable / shard,
                         f"{split}, reduce-scattered every micro-batch", home)
        backward = _fsdp_backward(sizes, cbytes, rbytes, shard, lora)
        grad_work = part("unsharded gradient in flight", backward.gradient,
                         "LoRA: the adapters' only" if lora else
                         f"1 block in {s.compute_dtype} + its reduce-scatter copy in "
                         f"{s.reduce_dtype}, or that copy + its reduced shard")
        unsharded_backward = part("FSDP unsharded blocks (backward)", backward.unsharded,
                                  f"root + a block + the next one prefetched, in "
                                  f"{s.compute_dtype}")
        unsharded = part("FSDP unsharded blocks (forward)",
                         cbytes * _fsdp_forward_parameters(sizes),
                         f"root + the previous all-gather buffer + a block's buffer and its "
                         f"unsharded copy, in {s.compute_dtype}")
    else:
        gradients = part("gradients (fp32)", 4 * trainable, "full copy, kept across "
                         "accumulation (no_sync)" if s.parallelism == "ddp" else "full copy")
        ddp = s.parallelism == "ddp" and s.world_size > 1
        grad_work = part("DDP gradient buckets", 4 * trainable if ddp else 0,
                         "a second copy of the gradients" if ddp else "no DDP")
        unsharded = unsharded_backward = 0.0
    adapters = Adapters(s.lora_rank, s.lora_targets) if lora else Adapters()
    precision = _call_precision(s)
    call_memory, decode_memory = (_call_memory, _decode_memory) if s.activations == "measured" \
        else (_call_bound, _decode_bound)
    train_call = call_memory(s.model, CallShape(s.train_rows, tokens, s.text_tokens), True,
                             s.gradient_checkpointing, adapters, precision)
    train_acts = part("activations (training call)", train_call.peak,
                      f"{s.train_rows} rows = {s.max_chunk} trained steps x micro-batch "
                      f"{s.micro_batch_size}, {tokens}+{s.text_tokens} tokens, "
                      f"{'with' if s.gradient_checkpointing else 'without'} checkpointing")

    def sampling_call(batch: int) -> float:
        call = call_memory(s.model, CallShape(batch, tokens, s.text_tokens), False, False,
                           adapters, precision)
        decode = decode_memory(s.model, batch, s.height, s.width, s.weights_dtype)
        return max(call.peak, decode.peak)

    roll_acts = part("activations (sampling call, VAE decode)", sampling_call(
        s.rollout_batch_size), f"{s.rollout_batch_size} rows, no grad")
    in_tensor = 4 * sizes.largest_tensor  # one full fp32 tensor (export gathers them whole)
    file_bytes = sizes.files["transformer"] / sizes.transformer  # per parameter (bf16: 2)
    # Sharded loading reads this rank's rows of one tensor at a time (`sharded_load`): a
    # shard-sized host slice in the checkpoint's dtype; a copy from the host into a CUDA tensor
    # of another dtype converts on the host first (one more shard-sized fp32 temporary).
    in_slice = (file_bytes + (4 if cuda else 0)) * sizes.largest_tensor / shard
    # The checkpoint pages a rank maps while filling: its rows of every tensor. They are the
    # node's page cache (host parts); on a CPU run they count in the process's resident memory.
    mapped = sizes.files["transformer"] / shard if fsdp else sizes.files["transformer"]

    # Everything held from the first optimizer step on.
    held = [("trainable weights", weights), ("frozen weights", frozen), ("hybrid base", base),
            ("text encoders", text), ("VAE", vae), ("reward model", reward),
            ("CUDA context", context), ("optimizer state", optimizer), ("EMA", ema),
            ("CPU runtime", runtime)]
    loaded = held[:7]
    offloaded = sum(host_rank.get(r.part, 0) for r in rows
                    if r.part.startswith(("trainable", "optimizer", "frozen", "gradients")))
    text_host = host_rank.get("text encoders", 0)

    def phase(name: str, gpu: list, host: list | None = None, rank_host: float = 0.0,
              note: str = "") -> PhasePlan:
        """A phase; ``rank_host`` bytes on each rank's CPU join the offloaded parts."""
        per_rank = rank_host + text_host + offloaded
        host = [*(host or []), ("per rank: " + note_of_rank(name), ranks * per_rank)]
        return PhasePlan(name, tuple((k, v) for k, v in gpu if v), tuple(
            (k, v) for k, v in host if v), per_rank, note)

    def note_of_rank(name: str) -> str:
        return {"load": "one full tensor in flight", "checkpoint": "tensors in flight",
                "export": "rank 0's gathered model"}.get(name, "offloaded / CPU parts")

    files = sizes.files
    page_cache = [("transformer checkpoint page cache", files["transformer"]),
                  ("text encoder + VAE page cache", files["text_encoders"] + files["vae"])]
    load_text = text_all if s.text_encoders == "cache" else text
    load_gpu = [*loaded[:3], ("text encoders", load_text), *loaded[4:],
                ("one weight quantized in flight",
                 wbytes * quantized.largest if quantized and cuda else 0)]
    load_host = in_slice if fsdp else 4 * trainable + frozen * shard
    if quantized is not None:  # the transformer read on the CPU, quantized layer by layer
        # (its memory-mapped checkpoint pages stay mapped until every layer is quantized)
        load_host = 4 * trainable + wbytes * sizes.transformer
    if fsdp:
        load_note = ("policy on meta, sharded, each rank filling its shards; then the base "
                     "from the shards, then the reward")
    elif quantized is not None:
        load_note = "policy read on the CPU, quantized layer by layer onto the device; the reward"
    else:
        load_note = "policy loaded whole onto the device, then the reward"
    load = phase("load", load_gpu, page_cache, load_host, load_note)
    # The fill precedes the base and the reward: on a CPU run its peak is the shards, encoders
    # and VAE with the mapped rows and the slice in flight, or the whole load after it.
    filling = weights + frozen + load_text + vae + load.host_rank_bytes + mapped if fsdp else 0
    out = [dataclasses.replace(load, process_peak=filling)]
    encoding = 2 * PROMPT_CACHE_BATCH * s.text_tokens * (
        sizes.configs.text_encoder_2.get("d_ff", 0) * wbytes)
    if s.text_encoders == "cache":
        out.append(phase("prompt_cache", [*loaded[:3], ("text encoders", text_all),
                                          *loaded[4:], ("encoder activations", encoding)],
                         note="text encoders on the GPU while encoding, then freed"))
    else:
        out.append(phase("prompt_cache", [],
                         note=f"model.text_encoders: {s.text_encoders}: nothing cached"))
    if s.profile_rows:
        profile_buffers = s.profile_rows * (s.num_steps + 1) * tokens * channels * 4
        out.append(phase("profile", [*loaded, ("FSDP unsharded blocks", unsharded),
                                     ("dequantized weight", dequant),
                                     ("activations (no-grad call)", sampling_call(
                                         s.profile_rows)),
                                     ("profile latents", profile_buffers)],
                         note=f"{s.profile_rows} prompts per batch, no grad"))
    else:
        out.append(phase("profile", [], note="no temporal profile (fixed, unweighted chunks)"))
    out.append(phase("rollout", [*held, ("rollout buffers", buffers),
                                 ("FSDP unsharded blocks", unsharded),
                                 ("dequantized weight", dequant),
                                 ("activations (sampling call)", roll_acts)],
                     note=f"{s.rollout_rows} rows in batches of {s.rollout_batch_size}"))
    reward_batch = s.reward_batch * pixels
    out.append(phase("reward", [*held, ("rollout buffers", buffers),
                                ("reward batch (images)", reward_batch)],
                     note=f"{s.reward_batch} images per call; the reward's own activations "
                          f"not measured"))
    # The backward's unsharded blocks and gradient in flight, or the forward's buffers when
    # they are larger (LoRA: no full gradient in flight).
    forward_extra = max(0.0, unsharded - unsharded_backward - grad_work)
    out.append(phase("train", [*held, ("rollout buffers", buffers), ("gradients", gradients),
                               ("gradient in flight / buckets", grad_work),
                               ("FSDP unsharded blocks", unsharded_backward),
                               ("FSDP forward all-gather buffers", forward_extra),
                               ("dequantized weight", dequant),
                               ("activations (training call)", train_acts)],
                     note=f"micro-batch {s.micro_batch_size}, "
                          f"parallel.reduce_dtype {s.reduce_dtype}"))
    eval_batch = min(s.rollout_batch_size, max(1, s.eval_rows))
    out.append(phase("eval", [*held, ("FSDP unsharded blocks", unsharded),
                              ("dequantized weight", dequant),
                              ("activations (sampling call)", sampling_call(eval_batch))],
                     rank_host=s.eval_rows * pixels,
                     note="no grad; the hybrid base resident" if base else "no grad"))
    if s.world_size > 1:
        out.append(phase("checkpoint", held, rank_host=4 * sizes.largest_tensor / shard,
                         note="sharded DCP: each rank writes its shards, one tensor at a time"))
        full = 4 * trainable + (wbytes * sizes.transformer if lora else 0)
        export_host = [("rank 0: the gathered transformer", full)]
        if lora:  # merging copies it, into a plain fp32 transformer
            export_host.append(("rank 0: LoRA merged (a copy, then fp32)",
                                full + 4 * sizes.transformer))
        if s.text_encoders == "cache":
            export_host.append(("rank 0: text encoders reloaded", text_all))
        out.append(phase("export", [*held, ("one full tensor in flight", in_tensor if fsdp
                                            else 0)], export_host,
                         note="gathered tensor by tensor onto rank 0's CPU, cast and saved"))
        out[-1] = dataclasses.replace(out[-1], host_rank_bytes=out[-1].host_rank_bytes
                                      + sum(b for _, b in export_host))
    else:
        # DCP writes the live weights, optimizer state and EMA averages (no copies); the
        # NaN/Inf check masks one tensor at a time (1 B per value). A CPU tensor is written from
        # its own memory, a CUDA one copied to the host first, one at a time: the largest
        # trained tensor in fp32 (full fine-tuning: the transformer's largest weight; LoRA: an
        # adapter's, 0.8 MB for FLUX.1-dev at r=64).
        largest = _largest_trained_tensor(s.model, s.lora_rank, s.lora_targets)
        out.append(phase("checkpoint", [*held, ("NaN/Inf check mask", largest)],
                         rank_host=4 * largest if cuda else 0,
                         note="DCP: the live state written tensor by tensor"
                              + (" through the host" if cuda else "")))
        if quantized is not None:
            out.append(_quantized_export(s, sizes, quantized, held, phase,
                                         text_all if s.text_encoders == "cache" else 0))
            return rows, out
        copy = wbytes * sizes.transformer
        out.append(phase("export", [*held, ("deep copy of the transformer", 4 * trainable
                                            + (copy if lora else 0))],
                         [("the exported transformer", copy)]
                         + ([("LoRA merged into an fp32 copy", 4 * sizes.transformer)]
                            if lora else []),
                         note="one process: a deep copy on the device, cast, saved from there"))
    return rows, out


def _quantized_export(s: PlanSettings, sizes: ModelSizes, quantized, held: list, phase,
                      text_reload: float) -> PhasePlan:
    """Export of a quantized base (`quantize.dequantized_transformer`): each layer dequantized
    to fp32 on the device, its LoRA delta added, the sum cast to bf16 into the CPU copy; text
    encoders reloaded on the CPU when they were freed after caching."""
    # the largest layer (an unadapted AdaLN projection) dequantized to fp32 before its cast;
    # an adapted layer's fp32 weight, delta and sum are smaller (the attention projections)
    in_flight = 4 * quantized.largest
    plain = 2 * sizes.transformer
    where = "the device" if s.device == "cuda" else "the CPU"
    return phase("export", [*held, ("one weight dequantized (fp32)", in_flight)],
                 rank_host=plain + text_reload,
                 note=f"dequantized layer by layer on {where}, LoRA merged, bf16 copy on the "
                      f"CPU ({plain / GB:.1f} GB) saved")


def _assumptions(s: PlanSettings, sizes: ModelSizes) -> list[str]:
    cuda = s.device == "cuda"
    tokens = image_tokens(s, sizes.configs)
    out = [
        f"parallelism {s.parallelism} on {s.world_size} {'GPU' if cuda else 'process'}(es), "
        f"{s.ranks_per_node} per node; compute {s.compute_dtype}"
        + (" (bf16 autocast, simulated with CPU autocast)" if s.compute_dtype == "bf16" else "")
        + f"; frozen weights, base, encoders and VAE in {s.weights_dtype}"
        + (f"; FSDP reduces gradients in {s.reduce_dtype}" if s.parallelism == "fsdp" else ""),
        (f"activations measured with FakeTensor at {s.height}x{s.width} ({tokens} image tokens, "
         f"{s.text_tokens} text tokens) and extrapolated from 1-2 blocks of each kind"
         if s.activations == "measured" else
         f"activations: analytic lower bounds at {s.height}x{s.width} ({tokens} image tokens)"),
        "the reward's own activations are not measured (no grad, one reward batch)",
        "host: checkpoint files in the page cache once per node (reclaimable), each rank's CPU "
        "parts times the ranks of a node",
    ]
    if cuda:
        out.append(f"CUDA context/workspace allowance {CUDA_CONTEXT_BYTES / GB:.0f} GB")
    if s.parallelism == "fsdp" and s.cpu_offload:
        out.append("parallel.cpu_offload: weights, gradients and optimizer state on the CPU")
    if s.base_quantization != "none":
        out.append(f"{s.base_quantization} base: the blocks' linear layers quantized by "
                   f"bitsandbytes (chunk_grpo.plan.quantized), loaded in {s.weights_dtype} on "
                   f"the CPU and quantized layer by layer onto the device; activations measured "
                   f"with the frozen weights in the compute dtype"
                   + ("; int8's activation-sized int8/int32 temporaries not counted"
                      if s.base_quantization == "int8" else ""))
    return out


def _reward_bytes(s: PlanSettings, cuda: bool) -> tuple[float, str]:
    """The reward models' bytes (bf16 on CUDA, fp32 on the CPU; unknown ones from
    --reward-gb) and a note naming them."""
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
    return nbytes, f"{what} ({known / 1e9:.2f}B params)"


# ----------------------------------------------------------------------------- levers

def _levers(s: PlanSettings) -> list[tuple[str, PlanSettings]]:
    """The changes that cut memory, each as (its config line, the changed settings)."""
    out = []
    if s.parallelism != "fsdp" and s.world_size > 1:
        out.append(("parallel.mode: fsdp", dataclasses.replace(s, parallelism="fsdp")))
    if s.lora_rank == 0:
        out.append((f"model.lora_rank: {LORA_LEVER_RANK}", dataclasses.replace(
            s, lora_rank=LORA_LEVER_RANK,
            lora_targets=s.lora_targets or ("to_q", "to_k", "to_v", "to_out.0"))))
    if s.lora_rank > 0 and s.base_quantization == "none" and s.parallelism != "fsdp":
        out.append(("model.base_quantization: nf4",
                    dataclasses.replace(s, base_quantization="nf4")))
    if s.optimizer == "adamw":
        out.append(("optim.name: adamw8bit", dataclasses.replace(s, optimizer="adamw8bit")))
    if not s.gradient_checkpointing:
        out.append(("model.gradient_checkpointing: true",
                    dataclasses.replace(s, gradient_checkpointing=True)))
    if s.micro_batch_size > 1:
        half = s.micro_batch_size // 2
        out.append((f"optim.micro_batch_size: {half}",
                    dataclasses.replace(s, micro_batch_size=half)))
    if s.text_encoders == "keep":
        out.append(("model.text_encoders: cache",
                    dataclasses.replace(s, text_encoders="cache")))
    if s.weights_dtype == "fp32" and s.device == "cuda":
        out.append(("model.weights_dtype: bf16", dataclasses.replace(s, weights_dtype="bf16")))
    if s.parallelism == "fsdp" and s.reduce_dtype == "fp32" and s.compute_dtype == "bf16":
        out.append(("parallel.reduce_dtype: bf16", dataclasses.replace(s, reduce_dtype="bf16")))
    if s.parallelism == "fsdp" and not s.cpu_offload:
        out.append(("parallel.cpu_offload: true", dataclasses.replace(s, cpu_offload=True)))
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
    return (f"memory plan: the {plan.peak_phase} phase peaks at {plan.peak_bytes / GB:.1f} GB "
            f"per GPU, over the {plan.gpu_bytes / GB:.1f} GB budget ({s.world_size} x "
            f"{s.device}, parallel.mode {s.parallelism}, model.lora_rank {s.lora_rank}); levers "
            f"by effect: {cuts}. Run python -m chunk_grpo.plan for the table of phases")


def plan_for_config(cfg: TrainConfig, world_size: int, gpu_bytes: float, *,
                    device: str | None = None, reward_gb: float | None = None,
                    gpus_per_node: int | None = None) -> Plan:
    """The memory plan of a training config on ``world_size`` devices of ``gpu_bytes``
    (``gpus_per_node`` of them per host, default min(world size, 8))."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if not math.isfinite(gpu_bytes) or gpu_bytes <= 0:
        raise ConfigError(f"GPU memory must be > 0, got {gpu_bytes}")
    try:
        settings = settings_from_config(cfg, world_size, device, reward_gb, gpus_per_node)
        return build_plan(settings, gpu_bytes)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err)) from None


def check_plan(cfg: TrainConfig, world_size: int, gpu_bytes: float, *,
               reward_gb: float | None = None) -> Plan:
    """The trainer's start-up check on CUDA, on the plan's per-phase peaks: the plan, or
    `PlanDoesNotFit` naming the phase over the budget, its peak and the levers that would cut
    it, in order of effect."""
    plan = plan_for_config(cfg, world_size, gpu_bytes, device="cuda", reward_gb=reward_gb)
    if not plan.fits:
        raise PlanDoesNotFit(does_not_fit_message(plan))
    return plan


def format_plan(plan: Plan, parts: bool = True) -> str:
    """The table of phases (GB per GPU, GB per host), the parts (``parts``), the assumptions
    and the verdict."""
    s = plan.settings
    lines = [f"Memory plan: {s.model} with reward {s.reward}, {s.world_size} x "
             f"{plan.gpu_bytes / GB:.0f} GB ({s.device}, {s.ranks_per_node} per node), "
             f"parallelism {s.parallelism}"
             f"{' + cpu_offload' if s.cpu_offload and s.parallelism == 'fsdp' else ''}, "
             f"{'LoRA r=' + str(s.lora_rank) if s.lora_rank else 'full fine-tuning'}"
             f"{'' if s.base_quantization == 'none' else f' on a {s.base_quantization} base'}, "
             f"{s.optimizer}",
             f"model configs: {plan.source}", ""]
    if parts:
        width = max(len(r.part) for r in plan.rows) + 2
        lines.append(f"{'part':<{width}}{'GB/GPU':>8}  {'where':<5} note")
        lines.append("-" * (width + 50))
        lines.extend(f"{r.part:<{width}}{r.gpu_bytes / GB:>8.2f}  {r.where:<5} {r.note}"
                     for r in plan.rows)
        lines.append("")
    lines.append(f"{'phase':<14}{'GB/GPU':>8}{'GB/host':>9}  note")
    lines.append("-" * 80)
    for p in plan.phases:
        mark = "  <- peak" if p.name == plan.peak_phase else ""
        lines.append(f"{p.name:<14}{p.gpu_bytes / GB:>8.2f}{p.host_bytes / GB:>9.2f}  "
                     f"{p.note}{mark}")
    lines.append("-" * 80)
    if s.parallelism == "fsdp":
        lines.append("train by parallel.reduce_dtype: " + ", ".join(
            f"{dtype} {nbytes / GB:.2f} GB/GPU" for dtype, nbytes in
            plan.train_by_reduce_dtype.items()) + f" (this config: {s.reduce_dtype})")
    lines.append("")
    lines.extend(f"assumes: {a}" for a in plan.assumptions)
    lines.append("")
    lines.append(plan.verdict())
    return "\n".join(lines)
