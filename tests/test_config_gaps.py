"""Prompts reach a real T5 as written, the guidance config field, and `device: cuda` without CUDA
as one line before anything is created."""

import pytest
import torch
from trainer_utils import TINY_DEFAULTS, TINY_SIZES, save_tiny_flux, tiny_config
from transformers import T5Tokenizer

from chunk_grpo.cli import run_command
from chunk_grpo.config import ConfigError
from chunk_grpo.models import FluxPolicy
from chunk_grpo.models.tiny import build_tiny_flux_pipeline
from chunk_grpo.prompts import reads_lowercase_only
from chunk_grpo.train import main
from chunk_grpo.trainer_setup import load_policy

WORDS = ["a", "cat", "red"]


def test_a_cased_t5_gets_the_prompt_as_written():
    # Room in the T5 embedding table for the cased vocabulary below.
    pipeline = build_tiny_flux_pipeline(WORDS + ["one", "two", "blue", "square"], **TINY_SIZES)
    lower_only = FluxPolicy(pipeline, TINY_DEFAULTS)  # the tiny word-level T5: lowercase only
    assert lower_only.lowercase_t5
    same = [lower_only.encode_prompts([p]).prompt_embeds for p in ("A Cat", "a cat")]
    torch.testing.assert_close(same[0], same[1], rtol=0, atol=0)

    # A T5 vocabulary with capitals, as a real T5 has ("▁The", "▁A", ...).
    pieces = ["a", "A", "cat", "Cat", "red"]
    cased = T5Tokenizer(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
                        + [("\u2581" + w, -1.0) for w in pieces], extra_ids=0)
    pipeline.tokenizer_2 = cased
    policy = FluxPolicy(pipeline, TINY_DEFAULTS)
    assert not policy.lowercase_t5 and not reads_lowercase_only(cased)
    upper, lower = (policy.encode_prompts([p]) for p in ("A Cat", "a cat"))
    assert (upper.prompt_embeds - lower.prompt_embeds).abs().max() > 1e-3
    torch.testing.assert_close(upper.pooled, lower.pooled)  # CLIP lowercases by itself
    ids = cased("A Cat").input_ids
    assert ids != cased("a cat").input_ids and cased.unk_token_id not in ids


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line_and_leaves_nothing(tmp_path, capsys):
    # The command's own entry point in this process (a subprocess spends 10-90 s importing the
    # trainer on the shared CI machine): main() under run_command, as `python -m` runs it.
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run_command(lambda: main(["--device", "cuda", "--output-dir", str(out)]),
                    "python -m chunk_grpo.train")
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "device: cuda is set but CUDA is not available" in lines[0]
    assert "use device: cpu or auto" in lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []
