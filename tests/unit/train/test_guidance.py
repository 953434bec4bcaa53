"""The guidance config field reaches a guidance-distilled model, and is refused for one without a
guidance embedding."""

import pytest
import torch
from trainer_utils import TINY_SIZES, save_tiny_flux, tiny_config

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.train.setup import load_policy

WORDS = ["a", "cat", "red"]


@pytest.fixture(scope="module")
def guided_model(tmp_path_factory):
    return save_tiny_flux(tmp_path_factory.mktemp("guided"), WORDS,
                          **{**TINY_SIZES, "guidance_embeds": True})


def test_guidance_field_sets_the_models_guidance(guided_model, tmp_path):
    default = load_policy(tiny_config(guided_model, tmp_path), torch.device("cpu"))
    assert default.guidance_scale == 3.5  # the side file's (FLUX.1-dev's) default
    policy = load_policy(tiny_config(guided_model, tmp_path, guidance=5.0), torch.device("cpu"))
    assert policy.guidance_scale == 5.0
    x = policy.initial_noise(1, torch.Generator().manual_seed(0))
    embeds = policy.encode_prompts(["a red cat"])
    with torch.no_grad():
        v5 = policy.velocity(x, 0.5, embeds)
        policy.guidance_scale = 3.5
        assert (policy.velocity(x, 0.5, embeds) - v5).abs().max() > 1e-4  # it reaches the model


def test_guidance_for_a_model_without_guidance_embedding_is_an_error(tmp_path):
    plain = save_tiny_flux(tmp_path / "plain", WORDS)
    with pytest.raises(ConfigError, match="no guidance embedding .* remove guidance"):
        load_policy(tiny_config(plain, tmp_path, guidance=5.0), torch.device("cpu"))
