import json
import math

import pytest
import torch

from chunk_grpo.cli.evaluate import main
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.evaluate.evaluation import evaluate_policy
from chunk_grpo.evaluate.stats import mean_ci95
from chunk_grpo.models import FluxPolicy
from chunk_grpo.rewards import build_reward, get_reward
from chunk_grpo.shapes import HELDOUT_PROMPTS_FILE, load_prompts
from chunk_grpo.train.metrics import captioned_grid

PROMPTS = load_prompts(HELDOUT_PROMPTS_FILE)[:3]


@pytest.fixture(scope="module")
def model_dir(tiny_flux):
    return tiny_flux


@pytest.fixture(scope="module")
def policy(model_dir):
    return FluxPolicy.from_pretrained(model_dir)


def test_cli_end_to_end(model_dir, tmp_path, capsys):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "eval"
    result = main(["--model.name", str(model_dir), "--data.eval_prompts", str(prompts_file),
                   "--out", str(out), "--sampling.steps", "2", "--images-per-prompt", "2",
                   "--run.seed", "1"])
    captured = capsys.readouterr()
    printed = captured.out
    assert "95% CI, n=6" in printed
    assert "sampling: 100%" in captured.err and "6/6" in captured.err  # the progress bar
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n"] == 6 == result.n
    assert 0.0 <= metrics["reward_mean"] <= 1.0
    assert metrics["reward_mean"] == pytest.approx(result.rewards.mean().item())
    assert metrics["reward_ci95"] == pytest.approx(mean_ci95(result.rewards)[1])
    for key in ("colour_acc", "shape_acc", "size_acc", "count_acc", "exact"):
        assert 0.0 <= metrics[key] <= 1.0
    assert metrics["sampling_seconds"] > 0
    settings = metrics["settings"]
    assert settings["sampling.steps"] == 2 and settings["sampling.sde"] == "ode"
    assert settings["run.seed"] == 1 and settings["images_per_prompt"] == 2
    assert settings["sampling.shift"] == 3.0 and settings["run.device"] == "cpu"
    # Two images per prompt: best of 2 is the mean of each prompt's better image.
    best = result.rewards.view(3, 2).max(dim=1).values
    assert metrics["best_of_2"]["mean"] == pytest.approx(best.mean().item())
    assert metrics["best_of_2"]["ci95"] == pytest.approx(mean_ci95(best)[1])
    assert "best of 2 per prompt" in printed
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [p for p in PROMPTS for _ in range(2)]
    from PIL import Image

    grid = Image.open(out / "grid.png")
    assert grid.width == 6 * 128 and grid.height > 128
    # The images were scored by the shapes reward itself.
    assert torch.allclose(result.rewards, get_reward("shapes")(result.images, result.prompts))


def test_evaluate_policy_is_deterministic_and_hybrid_with_itself_is_a_no_op(policy, model_dir):
    kwargs = dict(num_steps=3, seed=7)
    a = evaluate_policy(policy, PROMPTS, **kwargs)
    b = evaluate_policy(policy, PROMPTS, **kwargs)
    assert torch.equal(a.images, b.images) and torch.equal(a.rewards, b.rewards)
    assert a.images.shape == (3, 3, policy.height, policy.width)
    same_weights = FluxPolicy.from_pretrained(model_dir)
    hybrid = evaluate_policy(policy, PROMPTS, hybrid_base=same_weights, hybrid_steps=1, **kwargs)
    assert torch.allclose(hybrid.images, a.images, atol=1e-5)
    sde = evaluate_policy(policy, PROMPTS, sampler="flow", eta=0.7, **kwargs)
    assert not torch.allclose(sde.images, a.images, atol=1e-3)
    other_seed = evaluate_policy(policy, PROMPTS, num_steps=3, seed=8)
    assert not torch.equal(other_seed.images, a.images)


def test_mean_ci95_matches_student_t():
    mean, half = mean_ci95(torch.tensor([0.0, 1.0, 0.0, 1.0]))
    # t_{0.975, 3} = 3.18245, sample std = 0.57735, n = 4
    assert mean == 0.5 and half == pytest.approx(3.18245 * 0.57735 / 2, rel=1e-4)
    assert math.isnan(mean_ci95([0.3])[1])
    with pytest.raises(ValueError, match="at least one"):
        mean_ci95([])


def test_best_of_k_is_the_mean_best_over_every_k_subset():
    import itertools

    from chunk_grpo.evaluate.stats import best_of_k

    rewards = torch.rand(4, 6, generator=torch.Generator().manual_seed(0))
    for k in range(1, 7):
        brute = [sum(max(row[list(s)]) for s in itertools.combinations(range(6), k))
                 / math.comb(6, k) for row in rewards]
        assert best_of_k(rewards, k) == pytest.approx([float(b) for b in brute], abs=1e-6)
    assert best_of_k(rewards, 1) == pytest.approx(rewards.mean(dim=1).tolist(), abs=1e-6)
    assert best_of_k(torch.tensor([[0.2, 0.2, 0.9]]), 3) == pytest.approx([0.9])
    with pytest.raises(ValueError, match="k must be in 1..6"):
        best_of_k(rewards, 7)
    with pytest.raises(ValueError, match=r"\[prompts, images per prompt\]"):
        best_of_k(rewards.flatten(), 2)


def test_best_of_reports_powers_of_two_and_n(policy):
    one = evaluate_policy(policy, PROMPTS[:2], num_steps=2, images_per_prompt=1)
    assert one.best_of() == {} and not any(k.startswith("best_of") for k in one.metrics())
    six = evaluate_policy(policy, PROMPTS[:2], num_steps=2, images_per_prompt=6)
    assert list(six.best_of()) == [2, 4, 6]
    assert six.best_of()[6][0] == pytest.approx(six.rewards.view(2, 6).max(1).values.mean().item())
    means = [mean for mean, _ in six.best_of().values()]
    assert means == sorted(means) and means[0] >= six.reward_mean - 1e-6


def test_bad_arguments(policy, model_dir, tmp_path):
    with pytest.raises(ValueError, match="prompts"):
        evaluate_policy(policy, [])
    with pytest.raises(ValueError, match="images_per_prompt"):
        evaluate_policy(policy, PROMPTS, images_per_prompt=0)
    with pytest.raises(ConfigError, match="hybrid-base"):
        main(["--model.name", str(model_dir), "--out", str(tmp_path), "--eval.hybrid_steps", "2"])
    with pytest.raises(ValueError, match="captions"):
        captioned_grid(torch.zeros(2, 3, 8, 8), ["one caption"])


def test_compare_reports_the_paired_difference(model_dir, tmp_path, capsys):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")
    common = ["--model.name", str(model_dir), "--data.eval_prompts", str(prompts_file),
              "--sampling.steps", "2"]
    base = main([*common, "--out", str(tmp_path / "a"), "--run.seed", "3"])
    # Same model, prompts and seed: every image is identical, so the difference is exactly 0.
    capsys.readouterr()
    same = main([*common, "--out", str(tmp_path / "b"), "--run.seed", "3", "--run.progress",
                 "false", "--compare", str(tmp_path / "a")])
    captured = capsys.readouterr()
    assert "sampling:" not in captured.err and "+0.0000" in captured.out  # no progress bar
    paired = json.loads((tmp_path / "b" / "metrics.json").read_text())["paired"]
    assert paired["diff_mean"] == 0.0 and paired["changed_fraction"] == 0.0
    assert paired["n"] == 3
    assert torch.equal(same.rewards, base.rewards)


def test_paired_difference_values_and_mismatches(tmp_path):
    from chunk_grpo.evaluate.paired import paired_difference

    base = tmp_path / "base"
    base.mkdir()
    (base / "samples.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "reward": r}) + "\n"
                for p, r in zip(["p", "q", "r"], [0.2, 0.5, 0.9], strict=True)))
    (base / "metrics.json").write_text(json.dumps({"settings": {"seed": 0}}))
    rewards = torch.tensor([0.3, 0.5, 1.0]).double().numpy()
    d = paired_difference(["p", "q", "r"], rewards, {"seed": 0}, base)
    diffs = [0.1, 0.0, 0.1]
    assert d.diff_mean == pytest.approx(sum(diffs) / 3)
    assert d.diff_ci95 == pytest.approx(mean_ci95(diffs)[1])
    assert d.changed_fraction == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="other prompts"):
        paired_difference(["p", "r", "q"], rewards, {"seed": 0}, base)
    with pytest.raises(ValueError, match="run.seed=0, this run 1"):
        paired_difference(["p", "q", "r"], rewards, {"run.seed": 1}, base)
    # a baseline saved by an earlier version names the seed "seed": still compared
    with pytest.raises(ValueError, match="run.seed=0, this run 1"):
        paired_difference(["p", "q", "r"], rewards, {"seed": 1}, base)
    (base / "metrics.json").write_text(json.dumps({"settings": {"run.seed": 2}}))
    with pytest.raises(ValueError, match="run.seed=2, this run 0"):
        paired_difference(["p", "q", "r"], rewards, {"run.seed": 0}, base)
    with pytest.raises(ValueError, match="not an evaluation directory"):
        paired_difference(["p"], rewards[:1], {}, tmp_path / "missing")


def test_fidelity_checks_are_reported_beside_a_reward_without_details(policy):
    def brightness(images, prompts):
        return images.mean(dim=(1, 2, 3))

    shapes = get_reward("shapes")
    res = evaluate_policy(policy, PROMPTS, reward=brightness, guard=shapes, num_steps=2,
                          seed=3)
    expected = shapes.details(res.images, res.prompts)
    torch.testing.assert_close(res.rewards, brightness(res.images, res.prompts))
    assert res.attributes["fidelity_score"] == pytest.approx(float(expected["score"].mean()))
    assert res.attributes["colour_acc"] == pytest.approx(float(expected["colour_acc"].mean()))
    torch.testing.assert_close(res.guard_scores, expected["score"])  # per image, for pairing
    plain = evaluate_policy(policy, PROMPTS, reward=brightness, num_steps=2, seed=3)
    assert plain.attributes == {} and plain.guard_scores is None
    # A configured reward is a RewardMix, which has `details` of its own: the checks join them.
    mixed = evaluate_policy(policy, PROMPTS, reward=build_reward("jpeg_compressibility"),
                            guard=shapes, num_steps=2, seed=3)
    assert mixed.attributes["colour_acc"] == pytest.approx(float(expected["colour_acc"].mean()))
    # The shapes reward itself already reports its checks: nothing is added.
    own = evaluate_policy(policy, PROMPTS, reward=build_reward("shapes"), guard=shapes,
                          num_steps=2, seed=3)
    assert "fidelity_score" not in own.attributes and "colour_acc" in own.attributes
    torch.testing.assert_close(own.guard_scores, own.rewards)
    # A guard without checks of its own (a mix of one plain reward): its scores, as the
    # fidelity score too.
    plain_guard = evaluate_policy(policy, PROMPTS, reward=brightness, num_steps=2, seed=3,
                                  guard=build_reward("jpeg_compressibility"))
    assert plain_guard.attributes["fidelity_score"] == pytest.approx(
        float(plain_guard.guard_scores.mean()))


def test_settings_parse_under_the_configs_dotted_names():
    from chunk_grpo.cli.evaluate import evaluate_parser

    own, cfg = evaluate_parser().parse_config([
        "--model.name", "M", "--model.height", "32", "--model.width", "48",
        "--reward.name", "shapes=1.0,jpeg_compressibility=0.5", "--reward.device", "cpu",
        "--data.eval_prompts", "shapes:train", "--sampling.steps", "4", "--sampling.shift", "2",
        "--sampling.sde", "flow", "--sampling.eta", "0.3", "--sampling.cfg_scale", "0",
        "--sampling.batch_size", "5", "--eval.hybrid_steps", "1", "--run.seed", "9",
        "--run.device", "cpu", "--run.progress", "false", "--max-prompts", "2",
        "--images-per-prompt", "3", "--hybrid-base", "B", "--out", "O"])
    assert (cfg.model.name, cfg.model.height, cfg.model.width) == ("M", 32, 48)
    assert (cfg.reward.name, cfg.reward.device) == ("shapes=1.0,jpeg_compressibility=0.5", "cpu")
    s = cfg.sampling
    assert (s.steps, s.shift, s.sde, s.eta, s.cfg_scale, s.batch_size) == (4, 2.0, "flow", 0.3,
                                                                           0.0, 5)
    assert cfg.data.eval_prompts == "shapes:train" and cfg.eval.hybrid_steps == 1
    assert (cfg.run.seed, cfg.run.device, cfg.run.progress) == (9, "cpu", False)
    assert own == {"out": "O", "images_per_prompt": 3, "max_prompts": 2, "hybrid_base": "B",
                   "compare": None, "verbose": False}
    # the evaluation's own defaults: the ODE, no noise, the model's steps, shift and CFG scale
    _, cfg = evaluate_parser().parse_config([])
    assert (cfg.sampling.sde, cfg.sampling.eta, cfg.sampling.steps, cfg.sampling.shift,
            cfg.sampling.cfg_scale) == ("ode", 0.0, None, None, None)
    assert (cfg.model.name, cfg.reward.name, cfg.data.eval_prompts) == (
        "embedded", "shapes", "shapes:heldout")


@pytest.mark.parametrize("args, message", [
    (["--sampling.steps", "1"], "sampling.steps must be >= 2 or null"),
    (["--sampling.sde", "sde"], "sampling.sde must be one of ode, flow, dance, cps, cps_mse"),
    (["--sampling.eta", "-1"], "sampling.eta must be >= 0"),
    (["--sampling.batch_size", "0"], "sampling.batch_size must be >= 1"),
    (["--sampling.steps", "two"], "sampling.steps must be an int or null, got 'two'"),
    (["--model.height", "8"], "model.height must be >= 16 pixels"),
    (["--reward.device", "gpu"], "reward.device must be '' (the reward's own default)"),
    (["--run.device", "tpu"], "run.device must be one of auto, cpu, cuda"),
    (["--model", "M"], "--model is a section; set its keys, e.g. --model.name"),
    (["--prompts", "f.txt"], "did you mean 'data.eval_prompts'"),
    (["--sampler", "flow"], "did you mean 'sampling.sde'"),
    (["--steps", "2"], "did you mean 'sampling.steps'"),
    (["--quiet"], "did you mean 'run.progress'"),
    (["--hybrid-steps", "2"], "did you mean 'eval.hybrid_steps'"),
    (["--sampling.group_size", "2"], "unknown config key 'sampling.group_size'"),
])
def test_bad_settings_are_one_line_errors_naming_the_key(args, message):
    from chunk_grpo.cli.evaluate import evaluate_parser

    with pytest.raises(ConfigError) as err:
        evaluate_parser().parse_config(args)
    assert message in str(err.value) and "\n" not in str(err.value)
