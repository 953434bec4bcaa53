"""Reward mixes: the spec parser, totals and per-reward scores, per_reward advantages by hand,
device/dtype options, batching, and the trainer's per-reward logs and overlapped scoring."""

import pytest
import torch
import yaml
from trainer_utils import tiny_config

from chunk_grpo.algorithm.advantages import per_reward_advantages
from chunk_grpo.algorithm.rollout import RolloutSettings, sample_rollouts
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config, parse_args
from chunk_grpo.config.reward_spec import RewardSpecError, format_reward_spec, parse_reward_spec
from chunk_grpo.rewards import build_reward
from chunk_grpo.runtime import distributed as D
from chunk_grpo.train.loop import run, train_iteration
from chunk_grpo.train.metrics import read_metrics
from chunk_grpo.train.setup import build_trainer, resolve_reward


class Redness:
    def __call__(self, images, prompts):
        return images[:, 0].mean((1, 2)) - images[:, 1:].mean((1, 2, 3))


class Recorder:
    """Records the keyword options and the batch sizes it was called with."""

    made: list[dict] = []
    calls: list[int] = []

    def __init__(self, device=None, dtype=None):
        Recorder.made.append({"device": device, "dtype": dtype})

    def __call__(self, images, prompts):
        Recorder.calls.append(len(prompts))
        return images.float().mean(dim=(1, 2, 3))


def recorder_with_kwargs(**options):
    Recorder.made.append(dict(options))
    return lambda images, prompts: images.float().mean(dim=(1, 2, 3))


@pytest.fixture(autouse=True)
def toy_rewards(register_test_reward, brightness_reward):
    """This module's toy rewards, registered for each of its tests."""
    register_test_reward("test_mix_red", Redness)
    register_test_reward("test_mix_recorder", Recorder)
    register_test_reward("test_mix_kwargs", recorder_with_kwargs)


# ----------------------------------------------------------------------------- the spec

@pytest.mark.parametrize("spec, entries", [
    ("shapes", [("shapes", 1.0)]),
    ("pickscore=1.0,clip=0.5", [("pickscore", 1.0), ("clip", 0.5)]),
    (" pickscore = 2 , clip=-0.25 ", [("pickscore", 2.0), ("clip", -0.25)]),
    ("my_rewards:redness=0.5,shapes", [("my_rewards:redness", 0.5), ("shapes", 1.0)]),
    ("remote:http://127.0.0.1:8000=0.5,my_rewards:redness",
     [("remote:http://127.0.0.1:8000", 0.5), ("my_rewards:redness", 1.0)]),
    ("remote:http://127.0.0.1:8000", [("remote:http://127.0.0.1:8000", 1.0)]),
    ({"pickscore": 1.0, "clip": 0.5}, [("pickscore", 1.0), ("clip", 0.5)]),
    ({"shapes": 1, "redness": 0}, [("shapes", 1.0), ("redness", 0.0)]),
])
def test_spec_parses(spec, entries):
    assert parse_reward_spec(spec) == entries
    assert parse_reward_spec(format_reward_spec(entries)) == entries


@pytest.mark.parametrize("spec, message", [
    ("", "reward is empty"),
    ("a=1,,b=2", "empty entry"),
    ("=0.5", "without a name"),
    ("clip=abc", "reward entry 'clip=abc': the weight 'abc'"),
    ("clip=nan", "must be finite"),
    ("a=1,a=2", "'a' is named twice"),
    ("a=0,b=0", "every weight is 0"),
    ("remote:localhost", "remote:http://HOST:PORT"),
    ({"a": "x"}, "the weight 'x'"),
    ({"a": True}, "must be a number"),
    ({}, "mapping is empty"),
    (5, "must be a name or a mapping"),
])
def test_bad_specs_name_the_entry(spec, message):
    with pytest.raises(RewardSpecError, match=message):
        parse_reward_spec(spec)


def test_config_takes_a_yaml_mapping_or_a_flag(tmp_path):
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump({"reward": {"name": {"test_brightness": 1.0,
                                                        "test_mix_red": 0.5},
                                               "mix_advantage": "per_reward"}}))
    cfg = build_config(path)
    assert cfg.reward.name == "test_brightness=1.0,test_mix_red=0.5"
    assert cfg.reward.mix_advantage == "per_reward"
    _, overrides, _ = parse_args(["--reward.name", "test_brightness=1.0,my_mod:red=0.5"])
    assert build_config(None, overrides).reward.name == "test_brightness=1.0,my_mod:red=0.5"
    with pytest.raises(ConfigError, match="reward.name: reward entry 'clip=x'"):
        build_config(None, {"reward.name": "shapes,clip=x"})
    with pytest.raises(ConfigError, match="reward.name: reward 'a'"):
        build_config(None, {"reward.name": {"a": [1]}})
    with pytest.raises(ConfigError, match="mix_advantage must be one of total, per_reward"):
        build_config(None, {"reward.mix_advantage": "mean"})
    with pytest.raises(ConfigError, match="reward.device must be"):
        build_config(None, {"reward.device": "gpu"})
    with pytest.raises(ConfigError, match="reward.batch_size must be >= 0"):
        build_config(None, {"reward.batch_size": -1})


# ----------------------------------------------------------------------------- the mix

def test_mix_total_per_reward_scores_and_details():
    images = torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    prompts = [f"p{i}" for i in range(5)]
    mix = build_reward("test_brightness=1.0,test_mix_red=0.5")
    scores = mix.score(images, prompts)
    bright = images.mean(dim=(1, 2, 3))
    red = images[:, 0].mean((1, 2)) - images[:, 1:].mean((1, 2, 3))
    assert list(scores) == ["test_brightness", "test_mix_red"]
    torch.testing.assert_close(scores["test_brightness"], bright)
    torch.testing.assert_close(scores["test_mix_red"], red)
    torch.testing.assert_close(mix(images, prompts), bright + 0.5 * red)
    details = mix.details(images, prompts)
    torch.testing.assert_close(details["score"], bright + 0.5 * red)
    torch.testing.assert_close(details["test_mix_red"], red)
    # One reward of weight 1 is the reward itself, bit for bit.
    assert torch.equal(build_reward("test_brightness")(images, prompts), bright)


def test_reward_batch_size_splits_calls_without_changing_scores():
    images = torch.rand(7, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    Recorder.calls.clear()
    whole = build_reward("test_mix_recorder")(images, ["x"] * 7)
    split = build_reward("test_mix_recorder", batch_size=3)(images, ["x"] * 7)
    assert Recorder.calls == [7, 3, 3, 1]
    assert torch.equal(whole, split)


def test_device_and_dtype_reach_factories_that_take_them(tmp_path):
    Recorder.made.clear()
    build_reward("test_mix_recorder=1.0,test_mix_kwargs=1.0,test_brightness=1.0",
                 device=torch.device("cuda:1"), dtype=torch.bfloat16)
    want = {"device": torch.device("cuda:1"), "dtype": torch.bfloat16}
    assert Recorder.made == [want, want]  # Brightness takes no options and still builds
    # The trainer: the reward_device (else its own device), bf16 on CUDA, fp32 on the CPU.
    Recorder.made.clear()
    cfg = tiny_config(tmp_path, tmp_path / "run", {"reward.name": "test_mix_recorder"})
    resolve_reward(cfg, torch.device("cpu"))
    cfg_cuda = tiny_config(tmp_path, tmp_path / "run", {"reward.name": "test_mix_recorder",
                                                        "reward.device": "cuda:0"})
    resolve_reward(cfg_cuda, torch.device("cpu"))
    assert Recorder.made == [{"device": torch.device("cpu"), "dtype": torch.float32},
                             {"device": torch.device("cuda:0"), "dtype": torch.bfloat16}]


# ----------------------------------------------------------------------------- advantages

def test_per_reward_advantages_by_hand():
    a = [0.0, 1.0, 2.0, 5.0, 10.0, 10.0, 10.0, 14.0]  # two groups of 4
    b = [0.1, 0.1, 0.3, 0.5, 0.0, 0.2, 0.0, 0.2]
    weights, eps, clip = (1.0, 0.5), 1e-4, 1.5
    want = []
    for i in range(8):
        g = range(4 * (i // 4), 4 * (i // 4) + 4)
        total = 0.0
        for w, r in zip(weights, (a, b), strict=True):
            mean = sum(r[j] for j in g) / 4
            std = (sum((r[j] - mean) ** 2 for j in g) / 4) ** 0.5
            total += w * (r[i] - mean) / (std + eps)
        want.append(max(-clip, min(clip, total)))
    got = per_reward_advantages([(1.0, torch.tensor(a), None), (0.5, torch.tensor(b), None)],
                                4, eps=eps, clip_max=clip)
    torch.testing.assert_close(got, torch.tensor(want))
    assert float(got.abs().max()) == clip  # the clip bites on this data
    with pytest.raises(ValueError, match="at least one"):
        per_reward_advantages([], 4)


# ----------------------------------------------------------------------------- the trainer

def test_run_logs_every_reward_and_the_weighted_total(tiny_flux, tmp_path):
    model = tiny_flux
    out = run(tiny_config(model, tmp_path / "run", {
        "run.max_steps": 1, "reward.name": "test_brightness=1.0,test_mix_red=0.5",
        "reward.mix_advantage": "per_reward"}))
    record = read_metrics(out / "metrics.jsonl")[0]
    for key in ("reward/test_brightness_mean", "reward/test_brightness_std",
                "reward/test_mix_red_mean", "reward/test_mix_red_std", "time/reward_scoring"):
        assert key in record, key
    assert record["reward_mean"] == pytest.approx(
        record["reward/test_brightness_mean"] + 0.5 * record["reward/test_mix_red_mean"],
        abs=1e-6)
    assert record["skipped"] == 0 and record["adv_abs_max"] > 0


def test_overlapped_scoring_gives_the_same_iteration(tiny_flux, tmp_path):
    """Rows 0-7 in three rollout batches (3, 3, 2), scored on a worker thread or inline: the same
    rewards, advantages and update."""
    model = tiny_flux
    results = []
    for overlap in (True, False):
        cfg = tiny_config(model, tmp_path / f"run{overlap}", {
            "sampling.batch_size": 3, "reward.name": "test_brightness=1.0,test_mix_red=0.5",
            "reward.overlap": overlap})
        tr = build_trainer(cfg, tmp_path / f"run{overlap}", D.DistInfo())
        metrics, finite = train_iteration(tr, 0)
        assert finite
        results.append({k: v for k, v in metrics.items() if not k.startswith("time/")})
    assert results[0] == results[1]


def test_rollout_hook_sees_each_batch_in_order(tiny_flux, tmp_path):
    from chunk_grpo.models import FluxPolicy

    policy = FluxPolicy.from_pretrained(tiny_flux)
    seen = []
    rollout = sample_rollouts(policy, ["a red circle", "two blue squares"], RolloutSettings(
        group_size=3, num_steps=3, shift=3.0, kind="flow", eta=0.7, batch_size=4, seed=0),
        on_batch=lambda im, p, i: seen.append((i, im.clone(), p)))
    assert [i for i, _, _ in seen] == [0, 1]
    assert torch.equal(torch.cat([im for _, im, _ in seen]), rollout.images)
    assert [p for _, _, ps in seen for p in ps] == ["a red circle"] * 3 + ["two blue squares"] * 3


def test_g2rpo_per_reward_advantages_sum_over_finishes_and_rewards(tiny_flux, tmp_path):
    cfg = tiny_config(tiny_flux, tmp_path / "run", {
        "sampling.algorithm": "g2rpo", "sampling.shared_noise": True,
        "sampling.g2rpo_granularities": "1,2", "reward.mix_advantage": "per_reward",
        "reward.name": "test_brightness=1.0,test_mix_red=0.5", "loss.adv_clip_max": None})
    tr = build_trainer(cfg, tmp_path / "run", D.DistInfo())
    scored = []
    score = tr.reward_fn.score
    tr.reward_fn.score = lambda images, prompts: scored.append(score(images, prompts)) or scored[-1]
    metrics, finite = train_iteration(tr, 0)
    assert finite and len(scored) == 2  # the two finishes, each by both rewards
    want = per_reward_advantages([(w, s[label], None) for s in scored
                                  for label, w in (("test_brightness", 1.0),
                                                   ("test_mix_red", 0.5))], 4)
    assert metrics["adv_abs_max"] == pytest.approx(float(want.abs().max()))
    assert metrics["reward/test_mix_red_mean"] == pytest.approx(
        float(scored[0]["test_mix_red"].mean()))
