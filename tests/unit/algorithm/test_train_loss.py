"""The chunk loss as the trainer computes it (batched chunk calls + grpo_kernels) against the
formulas of docs/math.md written out here with one transformer call per sample and step."""

import math

import pytest
import torch

from chunk_grpo.algorithm.chunking import ChunkLayout
from chunk_grpo.algorithm.policy_update import (
    LossSettings,
    TrainUnit,
    UpdateRecord,
    accumulate_gradients,
    chunk_logprobs,
    plan_units,
    row_weights,
    unit_loss,
    unit_steps,
)
from chunk_grpo.algorithm.rollout import RolloutSettings, sample_rollouts
from chunk_grpo.models import FluxPolicy

ETA = 0.7


@pytest.fixture(scope="module")
def setup(tiny_flux):
    policy = FluxPolicy.from_pretrained(tiny_flux)
    rollout = sample_rollouts(policy, ["a red circle", "two blue squares"], RolloutSettings(
        group_size=3, num_steps=5, shift=3.0, kind="flow", eta=ETA, seed=0))
    return policy, rollout


def flow_logprob(x, v, x_next, s, s_next, s1):
    """docs/math.md's flow step: mean over elements of the Gaussian log-density."""
    std = ETA * math.sqrt(s / (1 - (s1 if s == 1 else s)))
    dt = s_next - s
    m = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
    n = std * math.sqrt(-dt)
    return (-(x_next - m) ** 2 / (2 * n**2) - math.log(n) - 0.5 * math.log(2 * math.pi)).mean()


def per_step_logprobs(policy, rollout):
    """[B, T-1] with one velocity call per (sample, step): no batching at all."""
    sig = rollout.sigmas.tolist()
    rows = []
    for i in range(rollout.latents.shape[0]):
        emb = rollout.prompt_embeds.index([int(rollout.prompt_index[i])])
        out = []
        for t in range(rollout.latents.shape[1] - 2):
            x, x_next = rollout.latents[i, t:t + 1], rollout.latents[i, t + 1:t + 2]
            v = policy.velocity(x, torch.tensor([sig[t]]), emb)
            out.append(flow_logprob(x, v, x_next, sig[t], sig[t + 1], sig[1]))
        rows.append(torch.stack(out))
    return torch.stack(rows)


def reference_loss(lp_new, lp_old, adv, layout, clip):
    """mean over samples and chunks of max(-A r, -A clamp(r)), r = exp(mean_chunk(diff))."""
    terms, clipped = [], 0
    for j in range(layout.num_chunks):
        steps = layout.steps(j)
        r = torch.exp((lp_new[:, steps] - lp_old[:, steps]).mean(dim=1))
        rc = r.clamp(1 - clip, 1 + clip)
        terms.append(torch.maximum(-adv * r, -adv * rc))
        clipped += int(((-adv * rc) > (-adv * r)).sum())
    return torch.stack(terms).mean(), clipped


def grads(policy):
    return [p.grad.clone() for p in policy.transformer.parameters() if p.grad is not None]


@pytest.mark.parametrize("sizes", [(1, 1, 1, 1), (2, 2), (1, 3), (4,)],
                         ids=["step-level", "chunks-2-2", "chunks-1-3", "sequence"])
def test_chunk_loss_gradient_matches_formula(setup, sizes):
    policy, rollout = setup
    layout, clip = ChunkLayout(sizes), 3e-4
    params = list(policy.transformer.parameters())
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        lp_old = per_step_logprobs(policy, rollout)
        g = torch.Generator().manual_seed(1)
        for p in params:  # move the policy so ratios differ from 1 and some get clipped
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * (p.std() if p.numel() > 1 else 1))
    adv = torch.tensor([1.5, -0.5, -1.0, 0.8, -1.2, 0.4])
    try:
        # The trainer's way: one batched transformer call and one multi-chunk loss call per
        # micro-batch unit.
        policy.transformer.zero_grad()
        chunk_steps = [layout.steps(j) for j in range(layout.num_chunks)]
        units = plan_units(list(range(layout.num_chunks)), 6, 3, torch.Generator().manual_seed(2))
        assert len(units) == 2 and all(u.chunks == tuple(range(layout.num_chunks)) for u in units)
        for u in units:
            steps = unit_steps(u, chunk_steps)
            new = chunk_logprobs(policy, rollout, rollout.prompt_embeds, u.rows, steps,
                                 kind="flow", eta=ETA, cfg_scale=1.0)
            loss, _ = unit_loss(new, lp_old[u.rows][:, steps], adv[u.rows],
                                [len(c) for c in chunk_steps], clip_low=clip, clip_high=clip)
            (loss / len(units)).backward()
        ours = grads(policy)
        # The formula, one call per sample and step.
        policy.transformer.zero_grad()
        want, clipped = reference_loss(per_step_logprobs(policy, rollout), lp_old, adv, layout,
                                       clip)
        want.backward()
        ref = grads(policy)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
        policy.transformer.zero_grad()
    assert 0 < clipped < 6 * layout.num_chunks  # both branches of the max are exercised
    scale = max(float(r.abs().max()) for r in ref)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4 * scale)


def test_row_weights_count_every_row_alike():
    rows = [torch.arange(3), torch.arange(3, 4)]
    units = [TrainUnit((0,), rows[0]), TrainUnit((0,), rows[1])]
    assert row_weights(units, [False, True]) == [0.75, 0.25]
    assert row_weights(units, [True, True]) == [1.0, 1.0]  # one step each
    split = [TrainUnit((j,), r) for r in rows for j in (0, 1)]  # one unit per chunk
    assert row_weights(split, [False, False, False, True]) == [0.375, 0.375, 0.125, 0.125]


def test_update_policy_scales_the_loss_over_units(setup):
    """On-policy (r = 1) with plain SGD, lr 1: the weight change is minus the gradient of
    mean_{i,j} -A_i r_ij, however the rows split into micro-batches."""
    policy, rollout = setup
    layout = ChunkLayout((1, 3))
    params = [p for p in policy.transformer.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    adv = torch.tensor([1.5, -0.5, -1.0, 0.8, -1.2, 0.4])
    settings = LossSettings(kind="flow", eta=ETA, cfg_scale=1.0, clip_low=0.2, clip_high=0.2)
    opt = torch.optim.SGD(params, lr=1.0)
    # 6 rows in micro-batches of 4 + 2: every row must weigh alike (not a mean of unit means).
    units = plan_units([0, 1], 6, 4, torch.Generator().manual_seed(3), split_chunks=True)
    assert sorted(u.rows.numel() for u in units) == [2, 2, 4, 4]
    record, boundaries = UpdateRecord(), 0
    try:
        for nonfinite in accumulate_gradients(policy, rollout, rollout.prompt_embeds, adv, units,
                                              [layout.steps(0), layout.steps(1)], settings,
                                              record):
            assert not nonfinite
            opt.step()
            opt.zero_grad(set_to_none=True)
            boundaries += 1
        delta = [p.detach() - s for p, s in zip(params, saved, strict=True)]
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
        policy.transformer.zero_grad()
        lp = per_step_logprobs(policy, rollout)
        want, _ = reference_loss(lp, lp.detach(), adv, layout, 0.2)
        want.backward()
        ref = [p.grad.clone() for p in params]
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
        policy.transformer.zero_grad()
    assert boundaries == 1
    assert all(s["ratio_mean"] == [1.0] * 2 for s in record.chunk_stats.values())
    scale = max(float(r.abs().max()) for r in ref)
    for d, r in zip(delta, ref, strict=True):
        torch.testing.assert_close(-d, r, rtol=1e-3, atol=1e-4 * scale)
