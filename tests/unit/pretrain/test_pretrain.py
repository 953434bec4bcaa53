"""`python -m chunk_grpo.pretrain` on a few steps: a loadable, normalised, reproducible model."""

import json

import pytest
import torch
from safetensors.torch import load_file

from chunk_grpo.cli import pretrain as pretrain_cli
from chunk_grpo.models import FluxPolicy
from chunk_grpo.pretrain import flux as pretrain

FAST = ["--num-images", "48", "--vae-steps", "2", "--vae-batch-size", "4", "--batch-size", "4"]
FAST += ["--warmup-steps", "1", "--ema-decay", "0.5", "--threads", "1"]


def _transformer_weights(directory):
    return load_file(directory / "transformer" / "diffusion_pytorch_model.safetensors")


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrain") / "model"
    pretrain_cli.main([*FAST, "--out", str(out), "--steps", "2", "--checkpoint-every", "1"])
    return out


def test_output_is_a_loadable_pipeline_with_its_sampling_settings(long_run):
    policy = FluxPolicy.from_pretrained(long_run)
    assert (policy.height, policy.width) == (64, 64)
    assert policy.max_sequence_length == pretrain.MAX_SEQUENCE_LENGTH
    settings = json.loads((long_run / "chunk_grpo.json").read_text())
    assert settings["default_cfg_scale"] == policy.default_cfg_scale == 3.0
    # Latent statistics set the VAE normalisation (FluxPipeline decodes z / scale + shift).
    config = policy.vae.config
    assert config.scaling_factor != 1.0 and config.shift_factor != 0.0
    with torch.no_grad():
        image = policy.decode(policy.initial_noise(1, torch.Generator().manual_seed(0)))
    assert image.shape == (1, 3, 64, 64)


def test_checkpoint_after_k_steps_equals_a_k_step_run(long_run, tmp_path):
    """Same seed -> same weights, and a long run's early checkpoint is a shorter run's result."""
    short = tmp_path / "short"
    pretrain_cli.main([*FAST, "--out", str(short), "--steps", "1"])
    early = _transformer_weights(long_run / "checkpoints" / "step_000001")
    again = _transformer_weights(short)
    assert early.keys() == again.keys()
    assert all(torch.equal(early[k], again[k]) for k in early)
    final = _transformer_weights(long_run)
    assert any(not torch.equal(early[k], final[k]) for k in early)


def test_bad_arguments_are_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse: one line, status 2
        pretrain_cli.parse_args(["--out", str(tmp_path), "--steps", "0"])
    assert exit_info.value.code == 2 and "--steps: must be >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--caption-dropout"):
        pretrain_cli.parse_args(["--out", str(tmp_path), "--caption-dropout", "1.5"])
