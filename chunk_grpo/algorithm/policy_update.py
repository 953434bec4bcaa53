"""Policy gradients chunk by chunk: recompute a unit's log-probs in one call, its chunk loss in
one call, backward. The optimizer step is not here: `accumulate_gradients` hands control back at
each accumulation boundary and the training loop steps (`chunk_grpo.train`).

A training unit is a micro-batch of rows with the chunks it trains. Its log-probs come from one
batched transformer call over (its chunks' steps) x (its rows), each at its own sigma, and its
loss from one `grpo_kernels.chunk_grpo_loss` call over all its chunks. The old log-probs are
exact: a unit trained before the first accumulation boundary of an iteration uses its own
detached recomputation (the policy has not moved since the rollout), and every other unit gets a
no-grad recomputation with the same call taken before any update. So the ratio is exactly 1
on-policy whatever the batch layout of the rollout was (the sampler's own log-probs differ from
the training call's in the last bits whenever the two batch layouts differ; they are kept as a
diagnostic).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

import grpo_kernels
from chunk_grpo.algorithm.rollout import Rollout, autocast_context
from chunk_grpo.runtime.parallelize import reshard_root


@dataclass(frozen=True)
class TrainUnit:
    chunks: tuple[int, ...]  # the chunks this micro-batch trains, in order
    rows: torch.Tensor  # [m] long, sorted


def plan_units(selected_chunks: list[int], num_rows: int, micro_batch_size: int,
               generator: torch.Generator | None = None, *,
               split_chunks: bool = False) -> list[TrainUnit]:
    """Rows shuffled into micro-batches; each micro-batch trains every selected chunk, in one
    unit (one transformer call and one loss call), or with ``split_chunks`` one unit per chunk
    (for per-chunk gradients)."""
    perm = torch.randperm(num_rows, generator=generator)
    units = []
    for rows in perm.split(micro_batch_size):
        rows = rows.sort().values
        if split_chunks:
            units.extend(TrainUnit((j,), rows) for j in selected_chunks)
        else:
            units.append(TrainUnit(tuple(selected_chunks), rows))
    return units


def optimizer_step_after(num_units: int, grad_accum: int) -> list[bool]:
    """Whether an accumulation boundary (an optimizer step) follows each unit: every
    ``grad_accum`` units, and after the last (0 = once, after the last)."""
    every = num_units if grad_accum == 0 else grad_accum
    return [(k + 1) % every == 0 or k == num_units - 1 for k in range(num_units)]


def optimizer_steps_per_iteration(rows: int, micro_batch_size: int, grad_accum: int,
                                  ppo_epochs: int) -> int:
    """The optimizer steps one iteration takes: its micro-batches (one unit each, whatever the
    chunks) grouped by ``grad_accum``, per PPO epoch. The learning-rate schedule's length and
    the loop both follow this one count."""
    units = math.ceil(rows / micro_batch_size)
    return sum(optimizer_step_after(units, grad_accum)) * ppo_epochs


@dataclass(frozen=True)
class LossSettings:
    """What the update needs of the config: the SDE's log-prob and the clipped loss."""

    kind: str
    eta: float
    cfg_scale: float
    clip_low: float
    clip_high: float
    kl_coef: float = 0.0
    kl_ref: str = "old"  # old (k3 in the fused loss) | reference (the base model's view)
    mixed_precision: str = "no"
    ppo_epochs: int = 1
    grad_accum: int = 0
    # The kernels' value checks read values back to the host (a sync per call); the trainer
    # turns them off once its config is checked.
    validate: bool = True


def unit_steps(unit: TrainUnit, chunk_steps: list[list[int]]) -> list[int]:
    """The transitions a unit trains, chunk after chunk."""
    return [t for j in unit.chunks for t in chunk_steps[j]]


def chunk_logprobs(policy, rollout: Rollout, prompt_embeds, rows: torch.Tensor,
                   steps: list[int], *, kind: str, eta: float, cfg_scale: float,
                   mixed_precision: str = "no", validate: bool = True,
                   sigma_max: float | None = None) -> torch.Tensor:
    """Log-probs [m, c] of the stored transitions x_t -> x_{t+1}, t in ``steps``, for ``rows``.

    One transformer call with m * c rows (sample-major), each at its own sigma. ``validate``:
    the kernel's value checks (a host sync). ``sigma_max``: the schedule's s_1 (default read
    from ``rollout.sigmas``).
    """
    m, c = rows.numel(), len(steps)
    device = rollout.latents.device
    t = torch.tensor(steps, dtype=torch.long)
    x = rollout.latents[rows][:, t].flatten(0, 1)
    x_next = rollout.latents[rows][:, t + 1].flatten(0, 1)
    sigma = rollout.sigmas[t].repeat(m).to(device)
    sigma_next = rollout.sigmas[t + 1].repeat(m).to(device)
    embeds = prompt_embeds.index(rollout.prompt_index[rows].repeat_interleave(c))
    with autocast_context(x.device, mixed_precision):
        v = policy.velocity(x, sigma, embeds, cfg_scale=cfg_scale)
    logp = grpo_kernels.sde_step_logprob(x, v, x_next, sigma, sigma_next, eta=eta, kind=kind,
                                         sigma_max=float(rollout.sigmas[1]) if sigma_max is None
                                         else sigma_max,
                                         validate=validate)
    return logp.view(m, c)


def unit_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
              chunk_sizes: list[int], *, clip_low: float, clip_high: float, kl_coef: float = 0.0,
              logp_ref: torch.Tensor | None = None, validate: bool = True
              ) -> tuple[torch.Tensor, dict]:
    """The chunk-level clipped loss of one unit (its chunks side by side in ``logp_new``
    [m, sum(chunk_sizes)]), in one `chunk_grpo_loss` call, plus an optional reference KL.

    KL: with ``logp_ref`` None, ``kl_coef`` weighs k3 against the old policy (in the fused
    loss); otherwise k3 against the reference log-probs is added here.
    """
    loss, stats = grpo_kernels.chunk_grpo_loss(
        logp_new, logp_old, advantages, chunk_sizes, clip_low=clip_low, clip_high=clip_high,
        kl_coef=kl_coef if logp_ref is None else 0.0, validate=validate)
    if logp_ref is not None and kl_coef > 0:
        diff = logp_ref.detach() - logp_new
        k3 = (torch.exp(diff) - diff - 1.0).mean()
        loss = loss + kl_coef * k3
        stats = dict(stats, ref_kl=k3.detach())
    return loss, stats


@dataclass
class UpdateRecord:
    """What one iteration's update did, for logging (the loop adds its optimizer steps).

    The losses, gradient norms and statistics stay on the device while the update runs
    (`note_unit`, `note_grad_norm`) and are read back once, by `read` (a single device-to-host
    copy), into the float fields below."""

    optimizer_steps: int = 0
    skipped_steps: int = 0  # optimizer steps dropped for a non-finite loss or gradient
    losses: list[float] = field(default_factory=list)  # of the units with a finite loss
    grad_norms: list[float] = field(default_factory=list)
    chunk_stats: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    rollout_logp_gap: float = 0.0  # max |sampler logp - training recomputation| (diagnostic)
    _units: list[tuple[tuple[int, ...], torch.Tensor, dict]] = field(default_factory=list)
    _norms: list[torch.Tensor] = field(default_factory=list)
    _gaps: list[torch.Tensor] = field(default_factory=list)

    def note_unit(self, chunks: tuple[int, ...], loss: torch.Tensor, stats: dict) -> None:
        """A unit's loss and statistics (device tensors, read later; a non-finite loss drops
        the unit's numbers then)."""
        self._units.append((chunks, loss.detach(), stats))

    def note_gap(self, gap: torch.Tensor) -> None:
        """A unit's max |sampler logp - recomputed logp| (a device tensor)."""
        self._gaps.append(gap.detach())

    def note_grad_norm(self, norm: torch.Tensor) -> None:
        """The gradient norm of a step that was taken (a device tensor)."""
        self._norms.append(norm.detach())

    def read(self) -> None:
        """Copy everything noted since the last read to the host, in one transfer, and file it:
        each finite unit's loss and its per-chunk ratio, clip fraction and KLs (`_stat_views`),
        the gradient norms and the largest log-prob gap."""
        units, self._units = self._units, []
        norms, self._norms = self._norms, []
        gaps, self._gaps = self._gaps, []
        pending = [loss for _, loss, _ in units] + norms + gaps
        stat_views = [_stat_views(chunks, stats) for chunks, _, stats in units]
        pending += [v for views in stat_views for _, _, v in views]
        if not pending:
            return
        values = iter(_to_host(pending))
        losses = [next(values) for _ in units]
        self.grad_norms.extend(next(values) for _ in norms)
        for _ in gaps:  # Python's max, in the order the units ran
            self.rollout_logp_gap = max(self.rollout_logp_gap, next(values))
        for loss, views in zip(losses, stat_views, strict=True):
            read = [(j, name, next(values)) for j, name, _ in views]
            if not math.isfinite(loss):
                continue
            self.losses.append(loss)
            for j, name, value in read:
                self.chunk_stats.setdefault(j, {}).setdefault(name, []).append(value)


def _stat_views(chunks: tuple[int, ...], stats: dict) -> list[tuple[int, str, torch.Tensor]]:
    """(chunk, name, 0-d tensor) for a unit's per-chunk ratio and clip fraction (the loss's
    per-chunk stats) and its approximate KLs, filed under each chunk the unit trains."""
    views = []
    for i, j in enumerate(chunks):
        if len(chunks) == 1:
            names = [n for n in ("ratio_mean", "clip_frac", "approx_kl", "ref_kl") if n in stats]
            views.extend((j, n, stats[n]) for n in names)
        else:
            views.append((j, "ratio_mean", stats["ratio_mean_per_chunk"][i]))
            views.append((j, "clip_frac", stats["clip_frac_per_chunk"][i]))
            views.extend((j, n, stats[n]) for n in ("approx_kl", "ref_kl") if n in stats)
    return views


def _to_host(values: list[torch.Tensor]) -> list[float]:
    """0-d tensors as Python floats, in one device-to-host copy (float64 holds every fp32 or
    bf16 value exactly, so each float equals ``float(value)``)."""
    device = values[0].device
    flat = torch.stack([torch.as_tensor(v, device=device).detach().reshape(())
                        .to(torch.float64) for v in values])
    return flat.cpu().tolist()


def row_weights(units: list[TrainUnit], step_after: list[bool]) -> list[float]:
    """Each unit's weight in its optimizer step: its rows over the step's rows, counted per
    distinct micro-batch (a micro-batch split into one unit per chunk counts once; each of its
    units then weighs its rows over the step's rows times chunks). So every row counts alike:
    a 3 + 1 split weighs the lone row 1/4, not 1/2 as a mean of unit means would."""
    weights, group = [], []
    for k, last in enumerate(step_after):
        group.append(k)
        if last:
            total = sum(units[i].rows.numel() * len(units[i].chunks) for i in group)
            weights.extend(units[i].rows.numel() * len(units[i].chunks) / total for i in group)
            group = []
    return weights


def accumulate_gradients(policy, rollout: Rollout, prompt_embeds, advantages: torch.Tensor,
                         units: list[TrainUnit], chunk_steps: list[list[int]],
                         settings: LossSettings, record: UpdateRecord, *,
                         grad_sync: Callable[[bool], AbstractContextManager] | None = None,
                         reference=None) -> Iterator[torch.Tensor]:
    """Backward of every unit's loss (``settings.ppo_epochs`` passes); at each accumulation
    boundary (every ``settings.grad_accum`` units) yield whether a loss since the last one was
    non-finite (a 0-d bool tensor on the device: nothing is read back here), and resume when
    the caller has stepped and zeroed the gradients. When the last unit is done, ``record``
    reads its numbers back once (`UpdateRecord.read`).

    Each unit's loss (a mean over its rows) is weighted by its share of the rows of its
    optimizer step (`row_weights`), so a step's gradient is that of the mean over its rows,
    however the micro-batches split. chunk_steps[j] lists chunk j's transitions.
    ``grad_sync(boundary)``: a context around each unit's forward and backward that lets
    gradients synchronise across ranks only before a boundary (None: no ranks to sync).
    A non-finite loss still runs its backward (under FSDP or DDP the backward holds
    collectives every rank must join); its step's gradients are then non-finite and the caller
    skips that step.
    ``reference``: the KL reference model (``settings.kl_ref`` "reference"), a policy view with
    ``velocity`` (`chunk_grpo.models.hybrid_base`: the adapters disabled under LoRA, a frozen copy
    of the initial transformer under full fine-tuning); its log-probs are taken once, before any
    update.
    """
    use_reference = settings.kl_coef > 0 and settings.kl_ref == "reference"
    if use_reference and reference is None:
        raise ValueError("kl_ref 'reference' needs the reference model: pass reference= (the "
                         "base view of chunk_grpo.models.hybrid_base)")
    step_after = optimizer_step_after(len(units), settings.grad_accum)
    weights = row_weights(units, step_after)
    first_boundary = step_after.index(True)
    sigma_max = float(rollout.sigmas[1])  # read once, not per unit

    def logprobs(unit: TrainUnit, model=policy) -> torch.Tensor:
        return chunk_logprobs(model, rollout, prompt_embeds, unit.rows,
                              unit_steps(unit, chunk_steps), kind=settings.kind, eta=settings.eta,
                              cfg_scale=settings.cfg_scale,
                              mixed_precision=settings.mixed_precision,
                              validate=settings.validate, sigma_max=sigma_max)

    # Old log-probs of units trained after the policy may first move, taken before it moves.
    snapshot: dict[int, torch.Tensor] = {}
    ref_logps: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for k, unit in enumerate(units):
            if settings.ppo_epochs > 1 or k > first_boundary:
                snapshot[k] = logprobs(unit)
        if use_reference:
            ref_logps = {k: logprobs(unit, reference) for k, unit in enumerate(units)}
            # FSDP2 keeps a sharded frozen copy's root gathered after a no-grad forward
            reshard_root(getattr(reference, "base_transformer", None))

    bad = None
    for _epoch in range(settings.ppo_epochs):
        for k, unit in enumerate(units):
            # DDP decides in the forward whether the backward syncs: both go inside the context.
            with grad_sync(step_after[k]) if grad_sync is not None else nullcontext():
                logp_new = logprobs(unit)
                steps = unit_steps(unit, chunk_steps)
                if k in snapshot:
                    logp_old = snapshot[k]
                else:
                    logp_old = logp_new.detach()
                    record.note_gap((logp_old - rollout.logps[unit.rows][:, steps]).abs().max())
                loss, stats = unit_loss(logp_new, logp_old, advantages[unit.rows],
                                        [len(chunk_steps[j]) for j in unit.chunks],
                                        clip_low=settings.clip_low, clip_high=settings.clip_high,
                                        kl_coef=settings.kl_coef, logp_ref=ref_logps.get(k),
                                        validate=settings.validate)
                (loss * weights[k]).backward()
            record.note_unit(unit.chunks, loss, stats)
            nonfinite = ~torch.isfinite(loss.detach())
            bad = nonfinite if bad is None else bad | nonfinite
            if step_after[k]:
                yield bad
                bad = None
    record.read()
