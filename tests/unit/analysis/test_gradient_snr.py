import json

import pytest
import torch
from trainer_utils import tiny_config

from chunk_grpo.analysis.gradient_snr import iteration_gradients, measure, snr_statistics
from chunk_grpo.cli.gradient_snr import main
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.runtime import distributed as D
from chunk_grpo.train.setup import build_trainer


class ImageBlindReward:
    """Scores that ignore the image: the expected policy gradient is exactly zero."""

    def __init__(self):
        self.generator = torch.Generator().manual_seed(0)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return torch.rand(images.shape[0], generator=self.generator)


@pytest.fixture(autouse=True)
def toy_rewards(register_test_reward, brightness_reward):
    """This module's toy rewards, registered for each of its tests."""
    register_test_reward("test_image_blind", ImageBlindReward)


def synthetic(k: int, p: int, signal_norm: float, noise_std: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(p, generator=gen)
    g = g / g.norm() * signal_norm
    return g + noise_std * torch.randn(k, p, generator=gen)


def test_statistics_recover_a_known_snr():
    # |g|^2 = 1, E|n|^2 = 400 * 0.158^2 = 10: SNR^2 = 0.1
    stats = snr_statistics(synthetic(200, 400, 1.0, 10 ** 0.5 / 20))
    assert stats["signal"] == pytest.approx(1.0, abs=0.15)
    assert stats["noise"] == pytest.approx(10.0, rel=0.02)
    assert stats["snr2_per_iteration"] == pytest.approx(0.1, abs=3 * stats["snr2_stderr"])
    assert 0 < stats["snr2_stderr"] < 0.03
    assert stats["iterations"] == 200 and stats["params"] == 400


def test_pure_noise_has_no_signal():
    stats = snr_statistics(synthetic(100, 300, 0.0, 1.0, seed=1))
    assert abs(stats["snr2_per_iteration"]) < 3 * stats["snr2_stderr"]
    assert abs(stats["mean_pairwise_cosine"]) < 0.01


def test_statistics_reject_too_few_gradients():
    with pytest.raises(ValueError, match="K >= 3"):
        snr_statistics(torch.ones(2, 5))
    with pytest.raises(ValueError, match="K >= 3"):
        snr_statistics(torch.ones(5))


@pytest.fixture(scope="module")
def model_dir(tiny_flux):
    return tiny_flux


def test_gradients_leave_the_trainer_as_it_was(model_dir, tmp_path):
    cfg = tiny_config(model_dir, tmp_path / "run")
    tr = build_trainer(cfg, tmp_path / "run", D.init_distributed("cpu"))
    before = [p.detach().clone() for p in tr.params]
    optimizer, scheduler = tr.optimizer, tr.scheduler
    grads, rewards = iteration_gradients(tr, [0, 1, 2], progress=False)
    assert grads.shape == (3, sum(p.numel() for p in tr.params)) and len(rewards) == 3
    assert all(torch.equal(a, p) for a, p in zip(before, tr.params, strict=True))
    assert tr.optimizer is optimizer and tr.scheduler is scheduler and tr.cfg is cfg
    assert not optimizer.state  # no step was taken
    # the same iteration at the same weights gives the same gradient; another differs
    again, _ = iteration_gradients(tr, [1], progress=False)
    assert torch.equal(again[0], grads[1]) and not torch.equal(grads[0], grads[1])


def test_per_chunk_gradients_add_up_to_the_iteration_gradient(model_dir, tmp_path):
    # chunks 2,2; 2 batches
    cfg = tiny_config(model_dir, tmp_path / "run", {"chunks.fraction": 1.0})
    tr = build_trainer(cfg, tmp_path / "run", D.init_distributed("cpu"))
    total, _ = iteration_gradients(tr, [0, 1, 2], progress=False)
    by_chunk, _ = iteration_gradients(tr, [0, 1, 2], progress=False, per_chunk=True)
    assert sorted(by_chunk) == [0, 1] and by_chunk[0].shape == total.shape
    assert not torch.allclose(by_chunk[0], by_chunk[1])
    # per chunk, every unit is its own step (loss not divided by the 4 units of the iteration)
    scale = float(total.abs().max())  # fp32 sums in another order: relative to the largest
    torch.testing.assert_close((by_chunk[0] + by_chunk[1]) / 4, total, rtol=1e-4,
                               atol=1e-5 * scale)
    # On-policy, a chunk's gradient is the mean of its steps' (docs/math.md's geometric mean):
    # the step-level layout of the same rollouts pins which gradient went to which chunk.
    steps_cfg = tiny_config(model_dir, tmp_path / "run", {"chunks.fraction": 1.0,
                                                          "chunks.spec": "step"})
    step_tr = build_trainer(steps_cfg, tmp_path / "run", D.init_distributed("cpu"))
    by_step, _ = iteration_gradients(step_tr, [0, 1, 2], progress=False, per_chunk=True)
    for j, (a, b) in enumerate([(0, 1), (2, 3)]):
        torch.testing.assert_close(by_chunk[j], (by_step[a] + by_step[b]) / 2, rtol=1e-4,
                                   atol=1e-5 * scale)
    stats = measure(cfg, iterations=3, progress=False, per_chunk=True)
    assert [stats["chunks"][j]["steps"] for j in (0, 1)] == [[0, 1], [2, 3]]
    assert stats["iterations"] == 3 and stats["chunks"][1]["iterations"] == 3


def test_an_image_blind_reward_shows_no_signal(model_dir, tmp_path):
    blind = measure(tiny_config(model_dir, tmp_path / "b", {"reward.name": "test_image_blind"}),
                    iterations=8, progress=False)
    assert blind["iterations"] == 8 and blind["images_per_iteration"] == 8
    assert blind["noise"] > 0 and blind["snr2_stderr"] > 0
    assert abs(blind["snr2_per_iteration"]) < 3 * blind["snr2_stderr"]


def test_cli_prints_and_writes_json(model_dir, tmp_path, capsys):
    out = tmp_path / "snr.json"
    args = ["--iterations", "3", "--json", str(out), "--model.name", str(model_dir),
            "--reward.name", "test_brightness", "--sampling.steps", "4", "--sampling.group_size",
            "2", "--sampling.prompts_per_step", "2", "--chunks.spec", "3",
            "--sampling.sde_window", "0", "--model.lora_rank", "0", "--run.progress", "false",
            "--eval.hybrid_steps", "0"]
    main(args + ["--per-chunk"])
    printed = capsys.readouterr().out
    assert "SNR^2 per iteration" in printed and "chunk 0 (steps [0, 1, 2])" in printed
    stats = json.loads(out.read_text())
    assert stats["iterations"] == 3 and stats["images_per_iteration"] == 4
    assert stats["chunks"]["0"]["steps"] == [0, 1, 2]
    with pytest.raises(ConfigError, match="iterations"):
        main(args[:1] + ["2"] + args[2:])
    with pytest.raises(ConfigError, match="unknown config key"):
        main(["--no-such-flag", "1"])
    with pytest.raises(ConfigError, match="G2RPO trains one branch step per iteration"):
        main(args + ["--per-chunk", "--sampling.algorithm", "g2rpo"])
