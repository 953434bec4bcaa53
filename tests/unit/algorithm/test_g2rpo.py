"""G2RPO: singular stochastic sampling (one ODE prefix per prompt, one branch step), finishes at
several granularities, the integrated advantage, and the trainer running it (ratio 1 on-policy,
resume equivalence)."""

import pytest
import torch
from trainer_utils import Killed, tiny_config, without_times

import grpo_kernels
from chunk_grpo.algorithm.advantages import group_advantages, multi_granularity_advantages
from chunk_grpo.algorithm.branching import sample_branch_rollouts, tail_sigmas
from chunk_grpo.algorithm.noise import initial_noise
from chunk_grpo.algorithm.rollout import RolloutSettings, denoise
from chunk_grpo.algorithm.sigmas import flux_sigmas
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.specs import GranularityError, parse_granularities
from chunk_grpo.models import FluxPolicy
from chunk_grpo.runtime import distributed as D
from chunk_grpo.train.checkpoint import load_checkpoint
from chunk_grpo.train.loop import run, train_iteration
from chunk_grpo.train.metrics import read_metrics
from chunk_grpo.train.setup import build_trainer, optimizer_steps_per_iter

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")

PROMPTS = ["a red circle", "two blue squares", "one green triangle"]
KW = dict(group_size=4, num_steps=5, shift=3.0, kind="flow", eta=0.7)


@pytest.fixture(scope="module")
def policy(tiny_flux):
    return FluxPolicy.from_pretrained(tiny_flux)


def _sample(policy, branch_step, seed=0, **overrides):
    settings = RolloutSettings(**{**KW, "seed": seed, **overrides})
    return sample_branch_rollouts(policy, PROMPTS, settings, branch_step=branch_step,
                                  granularities=(1, 2))


def _ode(policy, x, prompt_rows, sigmas):
    embeds = policy.encode_prompts([PROMPTS[i] for i in prompt_rows])
    out = denoise(policy, x, embeds, sigmas, sampler="ode", eta=0.0,
                  cfg_scale=policy.default_cfg_scale, keep=True, sigma_max=0.9)
    return out.x, out.latents


def test_granularities_and_tails():
    assert parse_granularities("1,2") == (1, 2) and parse_granularities("3") == (3,)
    for bad in ("", "0", "1,1", "a", "2,-1"):
        with pytest.raises(GranularityError, match="granularities"):
            parse_granularities(bad)
    sigmas = flux_sigmas(6, 3.0)
    assert torch.equal(tail_sigmas(sigmas, 2, 1), sigmas[2:])
    # Every other sigma from index 2 (2, 4, 6): ends at 0 on its own; from 1 (1, 3, 5) + 0.
    assert torch.equal(tail_sigmas(sigmas, 2, 2), sigmas[[2, 4, 6]])
    assert torch.equal(tail_sigmas(sigmas, 1, 2), sigmas[[1, 3, 5, 6]])
    assert torch.equal(tail_sigmas(sigmas, 1, 10), sigmas[[1, 6]])


@pytest.mark.parametrize("k", [0, 2])
def test_one_ode_prefix_per_prompt_one_branch_and_finishes(policy, k):
    rollout, images = _sample(policy, k)
    b, g = 12, 4
    assert rollout.latents.shape[:2] == (b, 6) and rollout.logps.shape == (b, k + 1)
    assert len(images) == 2 and torch.equal(images[0], rollout.images)
    sigmas = flux_sigmas(5, 3.0)
    # The prefix x_0..x_k is the prompt's ODE trajectory from its initial noise, the same for
    # the whole group.
    noise = initial_noise(policy, range(3), seed=0).float()
    _, prefix = _ode(policy, noise, [0, 1, 2], sigmas[:k + 1]) if k else (None, noise[:, None])
    assert torch.allclose(rollout.latents[:, :k + 1], prefix.repeat_interleave(g, 0), atol=1e-5)
    # The branch: every row its own x_{k+1}, with the sampler's log-prob in column k only.
    x_k, x_next = rollout.latents[:, k], rollout.latents[:, k + 1]
    assert not torch.allclose(x_next[0], x_next[1])
    assert torch.isnan(rollout.logps[:, :k]).all() and torch.isfinite(rollout.logps[:, k]).all()
    assert torch.isnan(rollout.latents[:, k + 2:]).all()  # finishes are not stored
    embeds = policy.encode_prompts([PROMPTS[i] for i in rollout.prompt_index.tolist()])
    with torch.no_grad():
        v = policy.velocity(x_k, sigmas[k].expand(b), embeds, cfg_scale=policy.default_cfg_scale)
    logp = grpo_kernels.sde_step_logprob(x_k, v, x_next, sigmas[k].expand(b),
                                         sigmas[k + 1].expand(b), eta=0.7, kind="flow",
                                         sigma_max=float(sigmas[1]))
    assert torch.allclose(logp, rollout.logps[:, k], atol=1e-4)
    # Each finish is the ODE from x_{k+1} at its stride, decoded.
    prompt_rows = rollout.prompt_index.tolist()
    for stride, finished in zip((1, 2), images, strict=True):
        x_end, _ = _ode(policy, x_next, prompt_rows, tail_sigmas(sigmas, k + 1, stride))
        assert torch.allclose(policy.decode(x_end).float(), finished, atol=1e-4)


def test_batch_split_antithetic_and_errors(policy):
    whole, images = _sample(policy, 1)
    split, split_images = _sample(policy, 1, batch_size=5)
    assert torch.allclose(whole.latents[:, :3], split.latents[:, :3], atol=1e-5)
    assert torch.allclose(images[1], split_images[1], atol=1e-5)
    # Antithetic pairs share x_k, so x_{k+1} of rows 2i and 2i+1 sum to twice the mean: the
    # same for both pairs of a group.
    anti, _ = _sample(policy, 1, antithetic_noise=True)
    x = anti.latents[:, 2]
    assert torch.allclose(x[0] + x[1], x[2] + x[3], atol=1e-5)
    assert not torch.allclose(x[0] + x[1], whole.latents[0, 2] + whole.latents[1, 2], atol=1e-3)
    with pytest.raises(ValueError, match="branch_step must be in"):
        _sample(policy, 4)
    with pytest.raises(ValueError, match="sampling.group_size must be even"):
        _sample(policy, 0, group_size=3, antithetic_noise=True)


def test_multi_granularity_advantages_sum_the_finishes():
    g = torch.Generator().manual_seed(0)
    fine, coarse = torch.rand(8, generator=g), torch.rand(8, generator=g)
    one = multi_granularity_advantages([fine], 4, clip_max=1.0)
    assert torch.equal(one, group_advantages(fine, 4, clip_max=1.0))
    both = multi_granularity_advantages([fine, coarse], 4, clip_max=2.5)
    expected = (group_advantages(fine, 4) + group_advantages(coarse, 4)).clamp(-2.5, 2.5)
    assert torch.allclose(both, expected)
    pooled = multi_granularity_advantages([fine, coarse], 4, norm="global",
                                          all_rewards=[fine * 2, coarse * 2])
    expected = (group_advantages(fine, 4, norm="global", all_rewards=fine * 2)
                + group_advantages(coarse, 4, norm="global", all_rewards=coarse * 2))
    assert torch.allclose(pooled, expected)
    with pytest.raises(ValueError, match="at least one finish"):
        multi_granularity_advantages([], 4)
    with pytest.raises(ValueError, match="all_rewards has 1 finishes"):
        multi_granularity_advantages([fine, coarse], 4, all_rewards=[fine])


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="shared_noise: true"):
        tiny_config(tmp_path, tmp_path / "r", {"sampling.algorithm": "g2rpo",
                                               "sampling.shared_noise": False})
    with pytest.raises(ConfigError, match="g2rpo_granularities"):
        tiny_config(tmp_path, tmp_path / "r", {"sampling.algorithm": "g2rpo",
                                               "sampling.g2rpo_granularities": "2,2"})
    with pytest.raises(ConfigError, match="algorithm must be one of"):
        tiny_config(tmp_path, tmp_path / "r", {"sampling.algorithm": "grpo2"})


def test_trainer_runs_g2rpo_on_policy_and_resumes_exactly(tiny_flux, tmp_path):
    model = tiny_flux
    settings = {"sampling.algorithm": "g2rpo", "sampling.shared_noise": True,
                "sampling.g2rpo_granularities": "1,3", "run.max_steps": 3,
                "run.checkpoint_every": 1, "optim.lr": 3e-3}
    straight = run(tiny_config(model, tmp_path / "a", settings))
    records = read_metrics(straight / "metrics.jsonl")
    for r in records:
        assert r["ratio_mean"] == 1.0  # one optimizer step per iteration: exactly on-policy
        assert r["chunks_trained"] in {"0", "1", "2", "3"} and "reward_mean_stride3" in r
    state = load_checkpoint(straight)
    assert state["run"]["chunk_layout"] == [1, 1, 1, 1]  # step level: chunk j is branch step j

    def kill_at_2(step, metrics):
        if step == 2:
            raise Killed

    with pytest.raises(Killed):
        run(tiny_config(model, tmp_path / "b", settings), on_step_end=kill_at_2)
    resumed = run(tiny_config(model, tmp_path / "b", settings), run_dir=tmp_path / "b",
                  resume=True)
    assert without_times(read_metrics(resumed / "metrics.jsonl")) == without_times(records)


def test_g2rpo_schedule_counts_the_optimizer_steps_it_takes(tiny_flux, tmp_path):
    """The schedule's length and the loop count optimizer steps the same way: G2RPO trains one
    step-level chunk, so with grad_accum 1 an iteration takes one step per micro-batch (not per
    chunk of the layout), and a cosine schedule ends exactly at the last step."""
    cfg = tiny_config(tiny_flux, tmp_path / "run", {"sampling.algorithm": "g2rpo",
                                                    "sampling.shared_noise": True,
                                                    "optim.grad_accum": 1,
                                                    "optim.schedule": "cosine",
                                                    "run.max_steps": 1})
    tr = build_trainer(cfg, tmp_path / "run", D.DistInfo())
    per_iteration = optimizer_steps_per_iter(cfg)
    assert per_iteration == 2  # 8 rows in micro-batches of 4
    metrics, finite = train_iteration(tr, 0)
    assert finite and metrics["optimizer_steps"] == per_iteration
    assert tr.scheduler.last_epoch == per_iteration
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # cosine's end
