import json

import pytest
import torch

from chunk_grpo.algorithm.dynamics import reward_spread_by_step
from chunk_grpo.cli.credit import main
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
    main(["--model", str(model), "--reward", "test_brightness", "--prompts-file", str(prompts),
          "--group-size", "2", "--num-steps", "3", "--out", str(tmp_path / "c")])
    saved = json.loads((tmp_path / "c" / "credit.json").read_text())
    assert len(saved["spread"]) == 2 and saved["settings"]["num_steps"] == 3
    assert "within-group reward std" in capsys.readouterr().out
