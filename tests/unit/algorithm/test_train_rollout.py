"""Batched group rollouts and `generate` (ODE/SDE, hybrid inference)."""

import pytest
import torch

from chunk_grpo.algorithm.noise import initial_noise, step_noise
from chunk_grpo.algorithm.rollout import (
    RolloutSettings,
    denoise,
    generate,
    sample_rollouts,
    sde_steps,
)
from chunk_grpo.algorithm.sigmas import flux_sigmas
from chunk_grpo.models import FluxPolicy

PROMPTS = ["a red circle", "two blue squares", "one green triangle"]


@pytest.fixture(scope="module")
def policies(tiny_flux):
    path = tiny_flux
    policy, base = FluxPolicy.from_pretrained(path), FluxPolicy.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a "trained" transformer: same VAE and text encoders, moved weights
        for p in policy.transformer.parameters():
            p.add_(0.1 * p.std() * torch.randn(p.shape, generator=g) if p.numel() > 1 else 0)
    return policy, base


def test_rollout_layout_and_determinism(policies):
    policy, _ = policies
    kw = dict(group_size=2, num_steps=4, shift=3.0, kind="dance", eta=0.5)
    r = sample_rollouts(policy, PROMPTS, RolloutSettings(seed=0, **kw))
    assert r.latents.shape[:2] == (6, 5) and r.logps.shape == (6, 3)
    assert r.images.shape == (6, 3, 32, 32) and 0 <= float(r.images.min())
    assert r.prompt_index.tolist() == [0, 0, 1, 1, 2, 2] and r.group_size == 2
    assert torch.equal(r.sigmas, flux_sigmas(4, 3.0))
    assert torch.isfinite(r.logps).all()
    again = sample_rollouts(policy, PROMPTS, RolloutSettings(seed=0, **kw))
    assert torch.equal(again.latents, r.latents) and torch.equal(again.logps, r.logps)
    # Independent noise per image by default; one noise per group when shared.
    assert not torch.equal(r.latents[0, 0], r.latents[1, 0])
    shared = sample_rollouts(policy, PROMPTS, RolloutSettings(seed=0, shared_noise=True, **kw))
    assert torch.equal(shared.latents[0, 0], shared.latents[1, 0])
    assert not torch.equal(shared.latents[0, -1], shared.latents[1, -1])  # the SDE diverges


def test_sde_window_rollout(policies):
    """Only the first k steps are stochastic: with shared noise a group agrees up to x_0 and
    diverges after, the later steps are the ODE's, and only k log-probs are kept."""
    policy, _ = policies
    kw = dict(group_size=2, num_steps=5, shift=3.0, kind="flow", eta=0.7, shared_noise=True)
    r = sample_rollouts(policy, PROMPTS[:1], RolloutSettings(seed=0, sde_window=2, **kw))
    assert r.logps.shape == (2, 2) and torch.isfinite(r.logps).all()
    assert not torch.equal(r.latents[0, 2], r.latents[1, 2])
    with torch.no_grad():  # steps 2.. are deterministic: recompute one ODE step by hand
        t = 3
        s, s_next = r.sigmas[t].expand(2), r.sigmas[t + 1].expand(2)
        embeds = r.prompt_embeds.index(r.prompt_index)
        v = policy.velocity(r.latents[:, t], s, embeds, cfg_scale=policy.default_cfg_scale)
        x_next = r.latents[:, t] + (s_next - s).view(-1, 1, 1) * v
    torch.testing.assert_close(r.latents[:, t + 1], x_next, rtol=1e-5, atol=1e-5)
    full = sample_rollouts(policy, PROMPTS[:1], RolloutSettings(seed=0, sde_window=99, **kw))
    assert full.logps.shape == (2, 4)  # the window never includes the last step


@pytest.mark.parametrize("kind", ["flow", "cps"])
@pytest.mark.parametrize("sde_window", [0, 2])
def test_rollout_noise_does_not_depend_on_the_batch_split(policies, kind, sde_window):
    """Every row keeps its noise whatever rollout_batch_size is, and that noise is the row's
    keyed draw (`chunk_grpo.algorithm.noise`): the same trajectories come out of `denoise` fed by
    hand."""
    policy, _ = policies
    kw = dict(group_size=2, num_steps=4, shift=3.0, kind=kind, eta=0.7, sde_window=sde_window)

    def rollout(batch_size):
        return sample_rollouts(policy, PROMPTS,
                               RolloutSettings(seed=4, batch_size=batch_size, **kw))

    whole, split = rollout(64), rollout(4)
    torch.testing.assert_close(split.latents, whole.latents, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(split.logps, whole.logps, rtol=1e-4, atol=1e-4)
    x = initial_noise(policy, range(6), seed=4).float()
    draws = step_noise(range(6), tuple(x.shape[1:]), sde_steps(4, sde_window), seed=4)
    embeds = whole.prompt_embeds.index(whole.prompt_index)
    with torch.no_grad():
        out = denoise(policy, x, embeds, whole.sigmas, sampler=kind, eta=0.7,
                      cfg_scale=policy.default_cfg_scale, keep=True, sde_window=sde_window,
                      step_noise=draws)
    assert torch.equal(out.latents, whole.latents) and torch.equal(out.logps, whole.logps)


def test_sde_generation_does_not_depend_on_the_batch_split(policies):
    def gen(batch_size):
        return generate(policies[0], PROMPTS, num_steps=4, sampler="flow", eta=0.7,
                        seed=3, batch_size=batch_size)

    torch.testing.assert_close(gen(1), gen(64), rtol=1e-4, atol=1e-4)


def test_trained_transitions():
    from chunk_grpo.config.specs import trained_transitions

    assert trained_transitions(10) == 9 and trained_transitions(10, 3) == 3
    assert trained_transitions(10, 10) == 9
    with pytest.raises(ValueError, match="sde_window"):
        trained_transitions(10, -1)


def test_cps_rollout_and_x0_decode(policies):
    policy, _ = policies
    r = sample_rollouts(policy, PROMPTS[:1], RolloutSettings(
        group_size=2, num_steps=3, shift=1.0, kind="cps", eta=0.5, seed=0, decode="x0"))
    assert r.logps.shape == (2, 2) and torch.isfinite(r.logps).all()
    with pytest.raises(ValueError, match="kind must be one of"):
        sample_rollouts(policy, PROMPTS, RolloutSettings(group_size=2, num_steps=3, shift=1.0,
                                                         kind="ode", eta=0.5))


def test_generate_hybrid(policies):
    policy, base = policies

    def gen(**kw):
        return generate(policy, PROMPTS, num_steps=4, seed=3,
                        **kw)

    alone = gen()
    assert alone.shape == (3, 3, 32, 32)
    torch.testing.assert_close(gen(batch_size=2), alone, rtol=1e-4, atol=1e-4)  # ODE: no noise
    # k = all steps: the policy alone; k = 0: the base alone; in between: something else.
    torch.testing.assert_close(gen(hybrid_base=base, hybrid_steps=4), alone)
    base_alone = generate(base, PROMPTS, num_steps=4, seed=3)
    torch.testing.assert_close(gen(hybrid_base=base, hybrid_steps=0), base_alone)
    mixed = gen(hybrid_base=base, hybrid_steps=2)
    assert not torch.allclose(mixed, alone) and not torch.allclose(mixed, base_alone)
    sde = gen(sampler="flow", eta=0.7)
    assert sde.shape == alone.shape and not torch.allclose(sde, alone)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(sampler="euler"), "sampler must be"),
        (dict(sampler="flow", eta=0.0), "eta must be > 0"),
        (dict(hybrid_steps=2), "needs hybrid_base"),
        (dict(batch_size=0), "batch_size"),
    ],
)
def test_generate_bad_arguments(policies, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(policies[0], PROMPTS, num_steps=4, **kwargs)


@pytest.mark.parametrize("shared", [True, False])
def test_antithetic_pairs_take_opposite_noise(policies, shared):
    policy, _ = policies
    kw = dict(group_size=4, num_steps=4, shift=3.0, kind="flow", eta=0.7, shared_noise=shared,
              seed=2)
    r = sample_rollouts(policy, PROMPTS[:2], RolloutSettings(antithetic_noise=True, **kw))
    x0 = r.latents[:, 0]
    if shared:
        assert torch.equal(x0[0], x0[1]) and torch.equal(x0[0], x0[3])
        # same start, opposite first-step noise: the pair is symmetric about the step's mean,
        # so both transitions have the same log-prob
        torch.testing.assert_close(r.logps[0::2, 0], r.logps[1::2, 0], rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(x0[1::2], -x0[0::2]) and not torch.equal(x0[0], -x0[2])
    assert not torch.equal(r.latents[0, -1], r.latents[1, -1])
    plain = sample_rollouts(policy, PROMPTS[:2], RolloutSettings(**kw))
    assert torch.equal(plain.latents[0::2], r.latents[0::2])  # the first of each pair as before
    with pytest.raises(ValueError, match="sampling.group_size must be even"):
        sample_rollouts(policy, PROMPTS[:2],
                        RolloutSettings(antithetic_noise=True, **dict(kw, group_size=3)))
