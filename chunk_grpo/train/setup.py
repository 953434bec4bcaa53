"""Everything a training run is built from before its first iteration: the prompts (read once),
the policy, the reward, the chunk layout, the optimizer and its schedule, and the `Trainer` that
holds them. Also what a checkpoint saves of a trainer and how it is restored.

Order matters for error reporting and memory (`chunk_grpo.train.loop.run`): the prompt sets are read
first, then the policy loads (under FSDP straight into its shards, `build_policy`), then the
reward, and they are checked against each other, all before the run directory exists, so a bad
input leaves nothing behind; the temporal-dynamics profile runs on the parallelized policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from chunk_grpo.algorithm.chunking import ChunkLayout, parse_chunk_spec
from chunk_grpo.algorithm.dynamics import propose_chunks, shared_dynamics
from chunk_grpo.algorithm.policy_update import LossSettings, optimizer_steps_per_iteration
from chunk_grpo.algorithm.rollout import RolloutSettings
from chunk_grpo.algorithm.samplers import BranchSampler, GroupSampler, Sampler
from chunk_grpo.algorithm.sigmas import dynamic_shift
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.reward_spec import resolve_guard_spec
from chunk_grpo.config.sampling_options import resolve_cfg_scale
from chunk_grpo.config.schema import TrainConfig
from chunk_grpo.config.specs import parse_granularities
from chunk_grpo.data.prompts import PromptSet, check_prompts, load_prompt_set
from chunk_grpo.models import EMBEDDED_MODEL, FluxPolicy
from chunk_grpo.models.hybrid_base import FrozenTransformerBase, hybrid_base
from chunk_grpo.models.loading import resolve_pipeline_dir
from chunk_grpo.models.policy_setup import prepare_transformer
from chunk_grpo.models.prompt_cache import text_encoder_device
from chunk_grpo.models.quantize import quantize_base
from chunk_grpo.models.sampling_defaults import apply_sampling_size
from chunk_grpo.models.sharded_load import fill_from_checkpoint, meta_transformer
from chunk_grpo.rewards import build_reward
from chunk_grpo.rewards.guard import Guard
from chunk_grpo.rewards.mix import RewardMix, as_reward_mix, check_reward_spec
from chunk_grpo.rewards.outputs import RewardError
from chunk_grpo.rewards.scoring import probe_reward
from chunk_grpo.runtime import distributed as D
from chunk_grpo.runtime.parallelize import ParallelismError, parallelize_transformer, unwrapped
from chunk_grpo.runtime.precision import resolve_mixed_precision
from chunk_grpo.runtime.weights_dtype import WEIGHTS_DTYPES, load_dtypes, resolve_weights_dtype
from chunk_grpo.train.metrics import MetricsLogger
from chunk_grpo.train.optim import EMA, build_lr_scheduler, build_optimizer
from chunk_grpo.train.phase_memory import active_phase
from chunk_grpo.train.plots import save_profile


@dataclass
class PromptSets:
    """The run's two prompt sets, read once."""

    train: PromptSet
    eval: PromptSet

    def items(self) -> list[tuple[str, PromptSet]]:
        return [("data.train_prompts", self.train), ("data.eval_prompts", self.eval)]


# What a run has done since its first step (kept in its checkpoints): optimizer steps taken,
# steps skipped for a NaN/Inf loss or gradient, iterations skipped for NaN/Inf rewards.
STEP_COUNTS = {"optimizer_steps": 0, "skipped_steps": 0, "reward_skipped": 0}


@dataclass
class Trainer:
    """Everything an iteration touches."""

    cfg: TrainConfig
    info: D.DistInfo
    run_dir: Path
    policy: FluxPolicy
    module: torch.nn.Module  # what trains: the transformer, FSDP-sharded or DDP-wrapped
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ema: EMA | None
    reward_fn: RewardMix
    train_prompts: list[str]
    eval_prompts: list[str]
    layout: ChunkLayout
    chunk_weights: torch.Tensor | None
    logger: MetricsLogger
    sampler: Sampler | None = None  # the rollout sampler (`build_sampler`)
    base_policy: object = None  # the base for hybrid evaluation (`chunk_grpo.models.hybrid_base`)
    reference: object = None  # the KL reference (`loss.kl_ref: reference`): the same base view
    # a reward scored beside the trained one (`chunk_grpo.rewards.guard`)
    guard: Guard | None = None
    base_evals: dict = field(default_factory=dict)  # image count -> the base's EvalResult
    final_evals: dict = field(default_factory=dict)  # "eval"/"eval_hybrid" -> final EvalResult
    warned_constant: set[str] = field(default_factory=set)  # rewards warned of as constant
    counts: dict[str, int] = field(default_factory=lambda: dict(STEP_COUNTS))  # whole run
    chunk_counts: list[int] = field(default_factory=list)  # per chunk: iterations that trained it
    stop_reason: str | None = None  # why the run stops before max_steps (the guard, the time)

    @property
    def shift(self) -> float:
        return sampling_shift(self.cfg, self.policy)

    @property
    def cfg_scale(self) -> float:
        return resolve_cfg_scale(self.policy, self.cfg.sampling.cfg_scale)

    @property
    def loss_settings(self) -> LossSettings:
        sampling, loss, optim = self.cfg.sampling, self.cfg.loss, self.cfg.optim
        return LossSettings(kind=sampling.sde, eta=sampling.eta, cfg_scale=self.cfg_scale,
                            clip_low=loss.clip_low, clip_high=loss.clip_high,
                            kl_coef=loss.kl_coef, kl_ref=loss.kl_ref,
                            mixed_precision=self.cfg.model.mixed_precision,
                            ppo_epochs=optim.ppo_epochs, grad_accum=optim.grad_accum,
                            validate=False)  # the config is checked: no host syncs


def rollout_settings(cfg: TrainConfig, policy: FluxPolicy) -> RolloutSettings:
    """What the rollouts need of the config (the shift and CFG scale resolved for ``policy``)."""
    sampling = cfg.sampling
    return RolloutSettings(group_size=sampling.group_size, num_steps=sampling.steps,
                           shift=sampling_shift(cfg, policy), kind=sampling.sde,
                           eta=sampling.eta,
                           cfg_scale=resolve_cfg_scale(policy, sampling.cfg_scale),
                           seed=cfg.run.seed, batch_size=sampling.batch_size,
                           shared_noise=sampling.shared_noise,
                           antithetic_noise=sampling.antithetic_noise, decode=sampling.decode,
                           mixed_precision=cfg.model.mixed_precision,
                           sde_window=sampling.sde_window,
                           validate=False)  # the config is checked: no host syncs


def build_sampler(cfg: TrainConfig, policy: FluxPolicy) -> Sampler:
    """The run's rollout sampler (`chunk_grpo.algorithm.samplers`), chosen by
    ``sampling.algorithm``."""
    settings = rollout_settings(cfg, policy)
    if cfg.sampling.algorithm == "g2rpo":
        return BranchSampler(settings, parse_granularities(cfg.sampling.g2rpo_granularities))
    return GroupSampler(settings)


def uses_reference_kl(cfg: TrainConfig) -> bool:
    """Whether the loss needs the reference model's log-probs (`loss.kl_ref: reference`)."""
    return cfg.loss.kl_ref == "reference" and cfg.loss.kl_coef > 0


# ----------------------------------------------------------------------------- inputs

def read_prompt_sets(cfg: TrainConfig) -> PromptSets:
    """Read and decode both prompt sets: the first thing a run checks, before any model loads,
    so a missing or unreadable file is reported at once."""
    sets = {}
    for key in ("data.train_prompts", "data.eval_prompts"):
        try:
            sets[key] = load_prompt_set(cfg.get(key))
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}") from None
    return PromptSets(train=sets["data.train_prompts"], eval=sets["data.eval_prompts"])


def check_prompt_sets(prompt_sets: PromptSets, policy: FluxPolicy, reward_fn: RewardMix,
                      guard: Guard | None = None) -> None:
    """Run both prompt sets through the tokenizers and the reward before the run directory
    exists (a prompt they cannot take fails now, not at the final evaluation), then call the
    rewards once on a probe batch (2 images of the model's size, the first training prompts):
    a reward that fails or returns the wrong thing stops here, in one line. The guard, if any,
    is checked and probed alike (`check_guard`)."""
    for key, prompt_set in prompt_sets.items():
        try:
            notes = check_prompts(prompt_set, policy, reward_fn)
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}") from None
        for note in notes:
            print(f"[chunk-grpo] {key}: {note}", flush=True)
    probe_reward(reward_fn, policy.height, policy.width, prompt_sets.train.prompts)
    if guard is not None:
        check_guard(guard, prompt_sets, policy)


def check_guard(guard: Guard, prompt_sets: PromptSets, policy: FluxPolicy) -> None:
    """The guard must score the evaluation prompts (a ConfigError otherwise) and, to be scored
    on the rollouts, the training prompts: a guard named in eval.guard_reward that cannot is a
    ConfigError, the `auto` one is then left to the evaluations (one line says so). Then one
    probe call, as for the reward."""
    checks = [("data.eval_prompts", prompt_sets.eval), ("data.train_prompts", prompt_sets.train)]
    for key, prompt_set in checks:
        try:
            check_prompts(prompt_set, None, guard.reward)
        except ConfigError as err:
            msg = f"eval.guard_reward {guard.spec!r} cannot score {key}: {err}"
            if key == "data.train_prompts" and guard.auto:
                guard.on_rollouts = False
                print(f"[chunk-grpo] {msg}; it is scored at the evaluations only", flush=True)
                continue
            raise ConfigError(f"{msg}; choose another eval.guard_reward, or none") from None
    probe = prompt_sets.train.prompts if guard.on_rollouts else prompt_sets.eval.prompts
    probe_reward(guard.reward, policy.height, policy.width, probe)


def check_reward_name(cfg: TrainConfig) -> None:
    """A ConfigError now, before any model loads, when the configured reward or guard (or a
    part of a mix) names no reward; they are built after the policy (`resolve_reward`)."""
    try:
        check_reward_spec(cfg.reward.name)
    except ValueError as err:
        raise ConfigError(f"reward: {err}") from err
    spec = guard_spec(cfg)
    if spec is not None:
        try:
            check_reward_spec(spec)
        except ValueError as err:
            raise ConfigError(f"eval.guard_reward: {err}") from err


def resolve_reward(cfg: TrainConfig, device: torch.device | None = None,
                   spec: str | None = None, key: str = "reward") -> RewardMix:
    """The configured reward (or mix; ``spec``: another one, named ``key`` in the messages) on
    ``reward_device`` (default: ``device``, the trainer's), in bf16 on CUDA and fp32
    elsewhere; or a ConfigError that says how to name one."""
    where = torch.device(cfg.reward.device or device or "cpu")
    dtype = torch.bfloat16 if where.type == "cuda" else torch.float32
    try:
        return build_reward(cfg.reward.name if spec is None else spec, device=where,
                            dtype=dtype, batch_size=cfg.reward.batch_size)
    except RewardError:
        raise
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from err


def guard_spec(cfg: TrainConfig) -> str | None:
    """The run's guard reward spec (`eval.guard_reward` resolved), or None for no guard."""
    return resolve_guard_spec(cfg.eval.guard_reward, reward=cfg.reward.name,
                              eval_prompts=cfg.data.eval_prompts)


def resolve_guard(cfg: TrainConfig, device: torch.device | None = None) -> Guard | None:
    """The run's guard (`chunk_grpo.rewards.guard`), built where the reward is, or None."""
    spec = guard_spec(cfg)
    if spec is None:
        return None
    return Guard(spec, resolve_reward(cfg, device, spec, key="eval.guard_reward"),
                 auto=cfg.eval.guard_reward.strip().lower() == "auto")


def sampling_shift(cfg: TrainConfig, policy: FluxPolicy) -> float:
    """The rollouts' sigma shift: ``cfg.sampling.shift``, or with ``dynamic_shift`` FLUX's
    resolution-dependent exp(mu) from the image's latent token count."""
    if not cfg.sampling.dynamic_shift:
        return cfg.sampling.shift
    rows, cols = policy.latent_grid()
    return dynamic_shift(rows * cols)


def model_path(spec: str) -> str:
    """The model directory or hub id; "embedded" is the tiny FLUX shipped in the package."""
    return str(EMBEDDED_MODEL) if spec == "embedded" else spec


def load_policy(cfg: TrainConfig, device: torch.device,
                transformer: torch.nn.Module | None = None) -> FluxPolicy:
    """The model as a FluxPolicy, at the configured image size (``transformer``: one to use
    instead of loading it, see `FluxPolicy.from_pretrained`)."""
    # Frozen parts in weights_dtype, the text encoders where `text_encoders` puts them.
    dtype, frozen_dtype = load_dtypes(cfg.model.weights_dtype, device, cfg.model.lora_rank)
    # a quantized base loads on the CPU and is quantized layer by layer onto the device
    quantized = cfg.model.base_quantization != "none"
    policy = FluxPolicy.from_pretrained(
        model_path(cfg.model.name), device=device, dtype=dtype, frozen_dtype=frozen_dtype,
        text_encoder_device=text_encoder_device(cfg.model.text_encoders, device),
        transformer=transformer, transformer_device="cpu" if quantized else None)
    try:
        apply_sampling_size(policy, cfg.model.height, cfg.model.width,
                            source=model_path(cfg.model.name),
                            found_file=policy.sampling_file_found,
                            how="model.height and model.width (--model.height H --model.width W, "
                                "or in the YAML)")
        policy.set_guidance(cfg.model.guidance)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return policy


def load_checked_policy(cfg: TrainConfig, device: torch.device,
                        transformer: torch.nn.Module | None = None) -> FluxPolicy:
    """The policy, once the config is known to suit it (checked here, not at the first
    evaluation, which may come only at the end of the run). Seeds torch first."""
    torch.manual_seed(cfg.run.seed)
    policy = load_policy(cfg, device, transformer)
    try:
        policy.latent_grid()
    except ValueError as err:
        raise ConfigError(f"model.height/model.width: {err}; choose an image size the model's "
                          "latent grid divides") from None
    eval_steps = policy.defaults.num_steps  # evaluation samples as `chunk_grpo.evaluate` does
    if cfg.eval.hybrid_steps > eval_steps:
        raise ConfigError(f"eval.hybrid_steps={cfg.eval.hybrid_steps} exceeds the {eval_steps} "
                          f"steps evaluation samples with (the model's default num_steps); set "
                          f"--eval.hybrid_steps to at most {eval_steps}, or 0 to skip hybrid "
                          f"evaluation")
    return policy


@dataclass
class PolicySetup:
    """The policy ready to train: prepared, spread over the ranks, with its hybrid base."""

    policy: FluxPolicy
    module: torch.nn.Module  # what trains: the transformer, FSDP-sharded or DDP-wrapped
    base: object = None  # the base for hybrid evaluation, None without it
    reference: object = None  # the KL reference (the same view), None without it


def _with_base(cfg: TrainConfig, policy: FluxPolicy, module: torch.nn.Module,
               view) -> PolicySetup:
    """The setup with the base view where hybrid evaluation or the reference KL uses it."""
    return PolicySetup(policy, module, view if cfg.eval.hybrid_steps else None,
                       view if uses_reference_kl(cfg) else None)


def quantized_compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """The dtype a quantized layer dequantizes to and computes in: bf16 under bf16 mixed
    precision, else the frozen weights' dtype."""
    if resolve_mixed_precision(cfg.model.mixed_precision, device).mode == "bf16":
        return torch.bfloat16
    return resolve_weights_dtype(cfg.model.weights_dtype, device)


def sharded_loading(cfg: TrainConfig) -> bool:
    """Whether the transformer loads straight into FSDP shards (`chunk_grpo.models.sharded_load`):
    under parallel.mode fsdp with a process group; otherwise it loads whole, as before."""
    return cfg.parallel.mode == "fsdp" and dist.is_initialized()


def build_policy(cfg: TrainConfig, info: D.DistInfo) -> PolicySetup:
    """Load, check, prepare (LoRA, checkpointing, attention) and parallelize the policy, and
    build its hybrid base. Under FSDP nothing is whole on any device: meta -> prepare -> shard
    -> fill from the checkpoint -> the base sharded the same way. Otherwise: load -> prepare ->
    base (a frozen copy) -> DDP or nothing."""
    model = cfg.model
    sharded = sharded_loading(cfg)
    meta = None
    if sharded:
        model_dir, _ = resolve_pipeline_dir(model_path(model.name))
        meta = meta_transformer(model_dir, load_dtypes(model.weights_dtype, info.device,
                                                       model.lora_rank)[0])
    policy = load_checked_policy(cfg, info.device, meta)
    if model.base_quantization != "none":  # before the adapters: peft wraps the quantized layers
        quantize_base(policy.transformer, model.base_quantization,
                      compute_dtype=quantized_compute_dtype(cfg, info.device), device=info.device)
    prepare_transformer(
        policy.transformer, lora_rank=model.lora_rank, lora_alpha=model.lora_alpha,
        lora_targets=model.lora_targets, gradient_checkpointing=model.gradient_checkpointing,
        attention_backend=model.attention_backend, lora_seed=cfg.run.seed)
    weights_dtype = resolve_weights_dtype(model.weights_dtype, info.device)
    # One base view serves hybrid evaluation and the reference KL: under full fine-tuning one
    # frozen copy of the transformer, whichever uses it.
    needs_base = bool(cfg.eval.hybrid_steps) or uses_reference_kl(cfg)
    if not sharded:
        # the base from the policy's own weights, before any step
        base = hybrid_base(policy, weights_dtype) if needs_base else None
        return _with_base(cfg, policy, parallelize_policy(cfg, policy, base, info), base)
    module = parallelize_policy(cfg, policy, None, info)
    # cpu_offload: FSDP2 keeps the shards in host memory and expects them there
    fill_from_checkpoint(policy.transformer, model_dir,
                         device="cpu" if cfg.parallel.cpu_offload else info.device,
                         lora_seed=cfg.run.seed)
    base = None
    if needs_base:
        base = hybrid_base(policy, weights_dtype,
                           shard=lambda m: parallelize_transformer(m, **_fsdp_options(cfg, info)))
    return _with_base(cfg, policy, module, base)


# ----------------------------------------------------------------------------- the trainer

def dynamics_settings(cfg: TrainConfig, policy: FluxPolicy, mixed_precision: str) -> dict:
    """`measure_dynamics`'s settings for a run's temporal-dynamics profile (the run's steps,
    shift, guidance, seed and batch), under the autocast ``mixed_precision``."""
    return dict(num_steps=cfg.sampling.steps, shift=sampling_shift(cfg, policy),
                cfg_scale=cfg.sampling.cfg_scale, seed=cfg.run.seed,
                batch_size=cfg.sampling.batch_size, mixed_precision=mixed_precision)


def resolve_layout(cfg: TrainConfig, policy: FluxPolicy, prompts: list[str], run_dir: Path,
                   info: D.DistInfo, sampler: Sampler | None = None
                   ) -> tuple[ChunkLayout, torch.Tensor | None]:
    """The run's fixed chunk layout: the sampler's if it fixes one (G2RPO trains one branch step
    per iteration: its layout is step level, chunk j = step j), else the config's; "auto" (or
    weighted sampling) measures the profile on the first training prompts, once for the job
    (`shared_dynamics`; rank 0 saves it). ``sampler``: the run's (default: from the config)."""
    sampler = build_sampler(cfg, policy) if sampler is None else sampler
    layout = sampler.layout(cfg.num_trained)
    if layout is None:
        layout = parse_chunk_spec(cfg.chunks.spec, cfg.num_trained, cfg.chunks.size)
    curve = None
    if layout is None or cfg.chunks.weighted:
        with active_phase("profile"):
            # Once for the job, under the run's autocast (FSDP: the ranks split the prompts).
            curve = shared_dynamics(policy, prompts[:cfg.chunks.profile_prompts], info=info,
                                    sharded=cfg.parallel.mode == "fsdp",
                                    **dynamics_settings(cfg, policy, cfg.model.mixed_precision))
        if layout is None:
            layout = propose_chunks(curve, cfg.chunks.max_size, cfg.num_trained)
        if info.is_main:
            save_profile(curve, layout, run_dir)
    return layout, curve


def optimizer_steps_per_iter(cfg: TrainConfig) -> int:
    """The optimizer steps of one iteration (`optimizer_steps_per_iteration` of its rows)."""
    sampling, optim = cfg.sampling, cfg.optim
    return optimizer_steps_per_iteration(sampling.prompts_per_step * sampling.group_size,
                                         optim.micro_batch_size, optim.grad_accum,
                                         optim.ppo_epochs)


def build_trainer(cfg: TrainConfig, run_dir: Path, info: D.DistInfo, *,
                  prompt_sets: PromptSets | None = None, layout: ChunkLayout | None = None,
                  chunk_weights: torch.Tensor | None = None, reward_fn=None,
                  setup: PolicySetup | None = None, guard: Guard | None = None) -> Trainer:
    """Everything an iteration needs; the prompts, policy (`build_policy`), reward and guard
    are read or built from the config unless given, in that order (the rewards after the
    policy is sharded), and the layout (with its chunk weights) measured unless given, on the
    parallelized policy (every rank takes part)."""
    prompt_sets = read_prompt_sets(cfg) if prompt_sets is None else prompt_sets
    setup = build_policy(cfg, info) if setup is None else setup
    reward_fn = resolve_reward(cfg, info.device) if reward_fn is None else as_reward_mix(
        reward_fn, cfg.reward.name)
    guard = resolve_guard(cfg, info.device) if guard is None else guard
    policy, module = setup.policy, setup.module
    # The sharded parameters, collected before any forward: after a no-grad forward FSDP2
    # leaves the root's own parameters unsharded (plain tensors) until the next backward.
    named = [(n, p) for n, p in unwrapped(module).named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    sampler = build_sampler(cfg, policy)  # chosen once, from the config
    if layout is None:
        layout, curve = resolve_layout(cfg, policy, prompt_sets.train.prompts, run_dir, info,
                                       sampler)
        chunk_weights = layout.chunk_weights(curve) if curve is not None else None
    optimizer = build_optimizer(params, name=cfg.optim.name, lr=cfg.optim.lr,
                                betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
                                weight_decay=cfg.optim.weight_decay)
    scheduler = build_lr_scheduler(optimizer, warmup_steps=cfg.optim.warmup_steps,
                                   total_steps=cfg.run.max_steps * optimizer_steps_per_iter(cfg),
                                   kind=cfg.optim.schedule)
    ema = None
    if cfg.optim.ema_decay > 0:
        ema = EMA(named, cfg.optim.ema_decay)
    return Trainer(cfg=cfg, info=info, run_dir=run_dir, policy=policy, module=module,
                   params=params,
                   optimizer=optimizer, scheduler=scheduler, ema=ema, reward_fn=reward_fn,
                   train_prompts=prompt_sets.train.prompts,
                   eval_prompts=prompt_sets.eval.prompts, layout=layout,
                   chunk_weights=chunk_weights,
                   logger=MetricsLogger(run_dir, enabled=info.is_main,
                                        report_to=cfg.run.report_to, name=cfg.run.name,
                                        project=cfg.run.wandb_project, config=cfg.to_dict()),
                   sampler=sampler, base_policy=setup.base, reference=setup.reference,
                   guard=guard,
                   chunk_counts=[0] * layout.num_chunks)


def _fsdp_options(cfg: TrainConfig, info: D.DistInfo) -> dict:
    """`parallelize_transformer`'s settings of the run: FSDP computes in bf16 when the run's
    mixed precision is bf16 and reduces gradients in ``parallel.reduce_dtype``."""
    bf16 = resolve_mixed_precision(cfg.model.mixed_precision, info.device).mode == "bf16"
    return dict(mode=cfg.parallel.mode, device=info.device, cpu_offload=cfg.parallel.cpu_offload,
                param_dtype=torch.bfloat16 if bf16 else None,
                reduce_dtype=WEIGHTS_DTYPES[cfg.parallel.reduce_dtype])  # the same names


def parallelize_policy(cfg: TrainConfig, policy: FluxPolicy, base, info: D.DistInfo
                       ) -> torch.nn.Module:
    """Spread the policy's transformer over the job's ranks (`chunk_grpo.runtime.parallelize`: FSDP2
    per block, or DDP; nothing on one process) and return the module that trains. A full-fine-
    tuning hybrid base given here (a frozen copy, loaded whole) is sharded the same way."""
    options = _fsdp_options(cfg, info)
    try:
        module = parallelize_transformer(
            policy.transformer, activation_checkpointing=cfg.model.gradient_checkpointing,
            compile_blocks=cfg.model.compile_blocks, **options)
        if isinstance(base, FrozenTransformerBase) and cfg.parallel.mode == "fsdp":
            parallelize_transformer(base.base_transformer, **options)
    except ParallelismError as err:
        raise ConfigError(str(err)) from None
    if module is not policy.transformer:  # DDP: the policy calls the wrapper
        policy.forward_module = module
    return module

