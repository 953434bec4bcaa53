"""Sampling: batched group rollouts that keep every latent and log-prob, and plain generation.

One loop (`denoise`) serves both: the whole batch goes through the transformer at each step
(never batch 1), prompts are encoded once and indexed per row, and SDE steps and their
log-probs come from `grpo_kernels`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

import grpo_kernels
from chunk_grpo.algorithm.noise import check_row_offset, initial_noise, step_noise
from chunk_grpo.algorithm.sigmas import flux_sigmas
from chunk_grpo.config.sampling_options import (
    SAMPLERS,
    check_antithetic,
    check_decode,
    check_sde_kind,
    resolve_cfg_scale,
)
from chunk_grpo.config.specs import trained_transitions
from chunk_grpo.runtime.parallelize import reshard_root
from chunk_grpo.runtime.precision import resolve_mixed_precision


@dataclass
class Rollout:
    """A batch of trajectories: G consecutive rows per prompt."""

    latents: torch.Tensor  # [B, T+1, N, C] float32: x_0 (noise) .. x_T (final)
    logps: torch.Tensor  # [B, W] float32 sampler log-probs of the W trained transitions
    sigmas: torch.Tensor  # [T+1] float32
    prompt_index: torch.Tensor  # [B] long: row -> prompt
    prompts: list[str]  # the P prompts
    images: torch.Tensor  # [B, 3, H, W] in [0, 1]
    prompt_embeds: object  # PromptEmbeds of the P prompts (encoded once)

    @property
    def group_size(self) -> int:
        return self.latents.shape[0] // len(self.prompts)


def autocast_context(device: torch.device, mixed_precision: str):
    """bf16 autocast for the transformer when asked ("auto": where the hardware runs bf16
    natively, `chunk_grpo.runtime.precision`); the same context in rollout and training."""
    if resolve_mixed_precision(mixed_precision, device).mode == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def sde_step(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
             *, kind: str, eta: float, sigma_max: float, generator: torch.Generator | None,
             noise: torch.Tensor | None = None, validate: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One stochastic step (x_next, logp [B]); the deterministic last cps step has no logp.

    ``noise`` (x's shape) is the step's standard normal draw; None draws it from ``generator``.
    ``validate``: the kernels' value checks (they read values back to the host).
    """
    if kind in ("cps", "cps_mse") and bool((sigma_next == 0).any()):
        return grpo_kernels.ode_step(x, v, sigma, sigma_next, validate=validate), None
    if noise is None:
        device = generator.device if generator is not None else x.device
        noise = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=device)
    return grpo_kernels.sde_step_sample(x, v, noise.to(x), sigma, sigma_next, eta=eta,
                                        kind=kind, sigma_max=sigma_max, validate=validate)


def sde_steps(num_steps: int, sde_window: int = 0) -> int:
    """How many leading steps an SDE sampler draws noise for (all, or the window's)."""
    return min(sde_window, num_steps) if sde_window else num_steps


@dataclass(frozen=True)
class HybridBase:
    """Hybrid inference: ``policy`` (with its own prompt embeddings) runs steps >= ``from_step``."""

    policy: object
    embeds: object
    from_step: int


@dataclass
class Denoised:
    """What one `denoise` run leaves."""

    x: torch.Tensor  # the final latents [B, ...]
    latents: torch.Tensor | None  # [B, T+1, ...] x_0 .. x_T when kept, else None
    logps: torch.Tensor | None  # [B, W] log-probs of the trained transitions; None for the ODE
    x0: torch.Tensor  # the last step's clean prediction x - sigma * v


def denoise(policy, x: torch.Tensor, embeds, sigmas: torch.Tensor, *, sampler: str,
            eta: float, cfg_scale: float, generator: torch.Generator | None = None,
            mixed_precision: str = "no", keep: bool = False, sde_window: int = 0,
            step_noise: torch.Tensor | None = None, sigma_max: float | None = None,
            hybrid: HybridBase | None = None, validate: bool = True) -> Denoised:
    """Run every step of ``sigmas`` on x with ``policy`` (``hybrid.policy`` from its step on).

    With an SDE ``sampler`` and ``sde_window`` k > 0, steps t >= k are ODE steps.
    ``step_noise`` [S, B, ...] holds the draws of the S = `sde_steps` leading stochastic steps
    (see `chunk_grpo.algorithm.noise.step_noise`); None draws each step's noise from ``generator``
    as it comes.
    ``sigma_max``: the schedule's s_1 for the flow kind (default sigmas[1]; give it when
    ``sigmas`` is the tail of a longer schedule). ``keep`` keeps every x_t. ``validate``: the
    kernels' value checks (host reads; a caller with checked settings turns them off).
    """
    steps = sigmas.numel() - 1
    b = x.shape[0]
    traj = [x] if keep else None
    logps = []
    x0 = x
    sigma_max = float(sigmas[1]) if sigma_max is None else sigma_max
    for t in range(steps):
        model, model_embeds = policy, embeds
        if hybrid is not None and t >= hybrid.from_step:
            model, model_embeds = hybrid.policy, hybrid.embeds
            if t == hybrid.from_step:  # the policy's part is done: its root resharded
                reshard_root(_sampled_transformer(policy))
        s = sigmas[t].expand(b).to(x.device)
        s_next = sigmas[t + 1].expand(b).to(x.device)
        with autocast_context(x.device, mixed_precision):
            v = model.velocity(x, s, model_embeds, cfg_scale=cfg_scale)
        x0 = x - s.view(-1, *([1] * (x.dim() - 1))) * v.float()
        if sampler == "ode" or (sde_window and t >= sde_window):
            x = grpo_kernels.ode_step(x, v.to(x.dtype), s, s_next, validate=validate)
            logp = None
        else:
            noise = None if step_noise is None else step_noise[t].to(x)
            x, logp = sde_step(x, v, s, s_next, kind=sampler, eta=eta, sigma_max=sigma_max,
                               generator=generator, noise=noise, validate=validate)
        if keep:
            traj.append(x)
        logps.append(logp)
    for model in (policy, hybrid.policy if hybrid is not None else None):
        reshard_root(_sampled_transformer(model))  # FSDP2 keeps a root unsharded otherwise
    latents = torch.stack(traj, dim=1) if keep else None
    logp_t = None
    if sampler != "ode":
        w = trained_transitions(steps, sde_window)
        logp_t = torch.stack(logps[:w], dim=1) if w > 0 else x.new_zeros(b, 0)
    return Denoised(x=x, latents=latents, logps=logp_t, x0=x0)


def _sampled_transformer(policy) -> torch.nn.Module | None:
    """The transformer ``policy.velocity`` runs: a frozen hybrid base's own copy, else the
    policy's (None for a policy without one)."""
    base = getattr(policy, "base_transformer", None)
    return base if base is not None else getattr(policy, "transformer", None)


def decode_images(policy, result: Denoised, decode: str = "final") -> torch.Tensor:
    """Images [B, 3, H, W] (float32) of the final latents, or of the last x0 prediction."""
    return policy.decode(result.x0 if decode == "x0" else result.x).float()


@dataclass
class RolloutSetup:
    """What both rollout samplers start from: the schedule, the CFG scale, the prompts encoded
    once and the prompt of every row (rows are prompt-major: G consecutive rows per prompt)."""

    sigmas: torch.Tensor
    cfg_scale: float
    prompt_embeds: object
    prompt_index: torch.Tensor  # [P * G] long
    row_offset: int  # the global index of row 0 (a rank's offset in the global batch)
    group_size: int

    @property
    def rows(self) -> int:
        return self.prompt_index.numel()

    @property
    def global_rows(self) -> range:
        """The global image index of every row: what its noise is keyed by."""
        return range(self.row_offset, self.row_offset + self.rows)

    @property
    def global_prompts(self) -> range:
        """The global index of every prompt: what shared (per-prompt) noise is keyed by."""
        first = self.row_offset // self.group_size
        return range(first, first + self.rows // self.group_size)


@dataclass(frozen=True)
class RolloutSettings:
    """What a training rollout needs of the config, built once (`chunk_grpo.algorithm.samplers`):
    the schedule, the SDE, the group, the noise layout and the batch the transformer sees.

    ``cfg_scale`` None: the model's default. ``validate``: the kernels' value checks (host
    reads; a caller with checked settings turns them off). ``shared_noise`` and
    ``sde_window`` are the group sampler's (G2RPO's initial noise is per prompt and its only
    stochastic step is the branch step).
    """

    group_size: int
    num_steps: int
    shift: float
    kind: str
    eta: float
    cfg_scale: float | None = None
    seed: int = 0
    batch_size: int = 64
    shared_noise: bool = False
    antithetic_noise: bool = False
    decode: str = "final"
    mixed_precision: str = "no"
    sde_window: int = 0
    validate: bool = True


def prepare_rollout(policy, prompts: list[str], settings: RolloutSettings,
                    row_offset: int) -> RolloutSetup:
    """Check a rollout's settings (one line naming the fix), then encode its prompts once."""
    check_sde_kind(settings.kind)
    check_decode(settings.decode)
    check_antithetic(settings.antithetic_noise, settings.group_size)
    check_row_offset(row_offset, settings.group_size)
    return RolloutSetup(sigmas=flux_sigmas(settings.num_steps, settings.shift),
                        cfg_scale=resolve_cfg_scale(policy, settings.cfg_scale),
                        prompt_embeds=policy.encode_prompts(list(prompts)),
                        prompt_index=torch.arange(len(prompts)).repeat_interleave(
                            settings.group_size),
                        row_offset=row_offset, group_size=settings.group_size)


@torch.no_grad()
def sample_rollouts(policy, prompts: list[str], settings: RolloutSettings, *, step: int = 0,
                    row_offset: int = 0,
                    on_batch: Callable[[torch.Tensor, list[str], int], None] | None = None
                    ) -> Rollout:
    """G trajectories per prompt with the SDE sampler, keeping x_t for every t and the log-probs.

    ``settings.sde_window`` k > 0 samples only the first k steps stochastically and the rest
    with the ODE (the Flow-GRPO-Fast / MixGRPO idea): with shared initial noise, every
    difference within a group then comes from the trained high-noise transitions.

    ``settings.antithetic_noise`` pairs rows 2i and 2i+1 of a group: the second takes the
    negated noise of the first (initial noise too unless shared). Each image's noise is still
    standard normal, so its log-probs and the estimator's expectation are unchanged; the
    reward's even part in the noise cancels within a pair. Needs an even group size.

    Noise is keyed by image (`chunk_grpo.algorithm.noise`): row r's initial and step noise come from
    (``settings.seed``, ``step``, ``row_offset`` + r), shared noise from the global prompt
    index, so a rank sampling rows [o, o + n) of a global batch (``row_offset`` o, a whole
    number of groups) draws what one process sampling the whole batch draws for them, whatever
    ``settings.batch_size``.

    Rows are prompt-major (rows p*G .. p*G+G-1 belong to prompt p). The transformer sees
    ``settings.batch_size`` rows at a time; prompts are encoded once. ``on_batch(images,
    row_prompts, index)`` is called with each batch's decoded images as soon as they exist (the
    trainer scores them on another thread while the next batch is sampled); it must not modify
    them.
    """
    s = settings
    setup = prepare_rollout(policy, prompts, s, row_offset)
    rows, prompt_index, batch_size = setup.rows, setup.prompt_index, s.batch_size
    if s.shared_noise:
        noise = initial_noise(policy, setup.global_prompts, seed=s.seed, step=step)
        noise = noise.repeat_interleave(s.group_size, 0)
    else:
        noise = initial_noise(policy, setup.global_rows, seed=s.seed, step=step)
    steps_noise = step_noise(setup.global_rows, tuple(noise.shape[1:]),
                             sde_steps(s.num_steps, s.sde_window), seed=s.seed, step=step)
    if s.antithetic_noise:  # rows are prompt-major and G is even: pairs never cross a group
        steps_noise[:, 1::2] = -steps_noise[:, 0::2]
        if not s.shared_noise:
            noise[1::2] = -noise[0::2]
    all_latents, all_logps, images = [], [], []
    for start in range(0, rows, batch_size):
        idx = prompt_index[start:start + batch_size]
        out = denoise(policy, noise[start:start + batch_size].float(),
                      setup.prompt_embeds.index(idx), setup.sigmas, sampler=s.kind, eta=s.eta,
                      cfg_scale=setup.cfg_scale, mixed_precision=s.mixed_precision, keep=True,
                      sde_window=s.sde_window,
                      step_noise=steps_noise[:, start:start + batch_size],
                      validate=s.validate)
        all_latents.append(out.latents)
        all_logps.append(out.logps)
        images.append(decode_images(policy, out, s.decode))
        if on_batch is not None:
            on_batch(images[-1], [prompts[i] for i in idx.tolist()], len(images) - 1)
    return Rollout(latents=torch.cat(all_latents), logps=torch.cat(all_logps),
                   sigmas=setup.sigmas, prompt_index=prompt_index, prompts=list(prompts),
                   images=torch.cat(images), prompt_embeds=setup.prompt_embeds)


@torch.no_grad()
def generate(policy, prompts: list[str], *, num_steps: int = 16, shift: float = 3.0,
             sampler: str = "ode", eta: float = 0.0, cfg_scale: float | None = None,
             seed: int = 0, index_offset: int = 0, batch_size: int = 64,
             hybrid_base=None, hybrid_steps: int = 0,
             mixed_precision: str = "no", progress: bool = False) -> torch.Tensor:
    """Images [B, 3, H, W] in [0, 1] for ``prompts``, one per prompt.

    sampler: "ode" or an SDE kind (then ``eta`` > 0). Hybrid inference: the first
    ``hybrid_steps`` steps use ``policy``, the rest ``hybrid_base`` (another FluxPolicy).
    ``progress``: a tqdm bar over the images.

    Image i's noise is keyed by (``seed``, ``index_offset`` + i) (`chunk_grpo.algorithm.noise`): a
    list split across ranks, each giving its first image's global index, samples the images one
    process sampling the whole list does.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    if sampler != "ode" and eta <= 0:
        raise ValueError(f"eta must be > 0 for the SDE sampler {sampler!r}, got {eta}")
    if batch_size < 1 or num_steps < 1:
        raise ValueError("batch_size and num_steps must be >= 1")
    if index_offset < 0:
        raise ValueError(f"index_offset must be >= 0 (the first image's global index), "
                         f"got {index_offset}")
    if hybrid_base is None and hybrid_steps:
        raise ValueError("hybrid_steps > 0 needs hybrid_base (the base FluxPolicy)")
    if hybrid_base is not None and not 0 <= hybrid_steps <= num_steps:
        raise ValueError(f"hybrid_steps must be in [0, {num_steps}], got {hybrid_steps}")
    cfg = resolve_cfg_scale(policy, cfg_scale)
    sigmas = flux_sigmas(num_steps, shift)
    # All draws up front, keyed by image: its noise depends on neither batch nor rank.
    images_index = range(index_offset, index_offset + len(prompts))
    initial = initial_noise(policy, images_index, seed=seed).float()
    steps_noise = None
    if sampler != "ode":
        steps_noise = step_noise(images_index, tuple(initial.shape[1:]), num_steps, seed=seed)
    images = []
    bar = tqdm(total=len(prompts), unit="img", desc="sampling", disable=not progress)
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start:start + batch_size])
        hybrid = None
        if hybrid_base is not None:
            hybrid = HybridBase(hybrid_base, hybrid_base.encode_prompts(batch), hybrid_steps)
        rows = slice(start, start + batch_size)
        out = denoise(policy, initial[rows], policy.encode_prompts(batch), sigmas,
                      sampler=sampler, eta=eta, cfg_scale=cfg, mixed_precision=mixed_precision,
                      hybrid=hybrid,
                      step_noise=None if steps_noise is None else steps_noise[:, rows])
        images.append(decode_images(policy, out))  # the VAE is shared: only transformers differ
        bar.update(len(batch))
    bar.close()
    return torch.cat(images)
