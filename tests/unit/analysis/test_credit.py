import json

import pytest
import torch

from chunk_grpo.algorithm.dynamics import reward_spread_by_step
from chunk_grpo.cli.credit import main
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.schema import TrainConfig
from chunk_grpo.models import FluxPolicy
from chunk_grpo.rewards import get_reward

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")

PROMPTS = ["a large red circle", "two small blue squares"]


def constant_reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return torch.full((images.shape[0],), 0.5)


@pytest.fixture(scope="module")
def policy(tiny_flux):
    return FluxPolicy.from_pretrained(tiny_flux)


def test_spread_per_trained_step_is_deterministic(policy):
    kwargs = dict(num_steps=4, shift=3.0, group_size=3, seed=5)
    a = reward_spread_by_step(policy, PROMPTS, get_reward("test_brightness"), **kwargs)
    b = reward_spread_by_step(policy, PROMPTS, get_reward("test_brightness"), **kwargs)
    assert a == b
    assert len(a["spread"]) == len(a["reward"]) == 3  # T - 1 trained steps
    assert a["sigma"][0] == 1.0 and a["sigma"] == sorted(a["sigma"], reverse=True)
    assert all(s > 0 for s in a["spread"])  # one SDE step makes the group's images differ


def test_an_image_blind_reward_has_no_spread(policy):
    out = reward_spread_by_step(policy, PROMPTS, constant_reward, num_steps=3, shift=3.0,
                                group_size=2)
    assert out["spread"] == [0.0, 0.0] and out["reward"] == [0.5, 0.5]
    with pytest.raises(ValueError, match="group_size"):
        reward_spread_by_step(policy, PROMPTS, constant_reward, num_steps=3, shift=3.0,
                              group_size=1)


def test_cli_writes_the_table(tiny_flux, tmp_path, capsys):
    model = tiny_flux
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    main(["--model.name", str(model), "--reward.name", "test_brightness",
          "--data.train_prompts", str(prompts), "--sampling.group_size", "2",
          "--sampling.steps", "3", "--sampling.sde_window", "2", "--run.device", "cpu",
          "--out", str(tmp_path / "c")])
    saved = json.loads((tmp_path / "c" / "credit.json").read_text())
    assert len(saved["spread"]) == 2 and saved["settings"]["sampling.steps"] == 3
    assert saved["settings"]["prompts"] == 2 and saved["settings"]["sampling.sde"] == "flow"
    # the command measures what reward_spread_by_step does with the config's settings
    policy = FluxPolicy.from_pretrained(model)
    direct = reward_spread_by_step(policy, PROMPTS, get_reward("test_brightness"), num_steps=3,
                                   shift=3.0, group_size=2, seed=0)
    assert saved["spread"] == pytest.approx(direct["spread"], abs=1e-5)
    assert "within-group reward std" in capsys.readouterr().out


def test_settings_are_the_training_configs_and_a_yaml_sets_them(tmp_path):
    from chunk_grpo.cli.credit import credit_parser

    preset = tmp_path / "run.yaml"
    preset.write_text("sampling: {steps: 12, sde: dance, eta: 0.4}\nreward: {name: shapes}\n")
    own, cfg = credit_parser().parse_config([
        "--config", str(preset), "--sampling.group_size", "4", "--data.train_prompts",
        "shapes:train", "--model.name", "M", "--sampling.shift", "2.5", "--run.seed", "7",
        "--prompts", "3", "--out", "O"])
    s = cfg.sampling
    assert (s.steps, s.sde, s.eta, s.group_size, s.shift) == (12, "dance", 0.4, 4, 2.5)
    assert (cfg.reward.name, cfg.data.train_prompts, cfg.model.name, cfg.run.seed) == (
        "shapes", "shapes:train", "M", 7)
    assert own["prompts"] == 3 and own["out"] == "O" and own["config"] == str(preset)
    _, default = credit_parser().parse_config([])
    assert default == TrainConfig()  # no flags: what a default training run samples


@pytest.mark.parametrize("args, message", [
    (["--sampling.eta", "0"], "sampling.eta must be > 0"),
    (["--sampling.sde", "ode"], "sampling.sde must be one of flow, dance, cps, cps_mse"),
    (["--sampling.group_size", "1", "--loss.adv_norm", "none"],
     "sampling.group_size must be >= 2 to measure a spread"),
    (["--num-steps", "4"], "did you mean 'sampling.steps'"),
    (["--kind", "flow"], "did you mean 'sampling.sde'"),
    (["--prompts-file", "p.txt"], "did you mean 'data.train_prompts'"),
    (["--group-size", "4"], "did you mean 'sampling.group_size'"),
    (["--model", "M"], "--model is a section; set its keys, e.g. --model.name"),
])
def test_bad_settings_are_one_line_errors_naming_the_key(tmp_path, args, message):
    with pytest.raises(ConfigError) as err:
        main([*args, "--out", str(tmp_path / "c")])
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "c").exists()
