"""`python -m chunk_grpo.profile`: the temporal-dynamics curve, proposed chunks, a PNG plot."""

import json

import pytest
import torch
from PIL import Image

from chunk_grpo.algorithm.chunking import relative_change
from chunk_grpo.algorithm.dynamics import measure_dynamics, propose_chunks
from chunk_grpo.algorithm.rollout import denoise
from chunk_grpo.algorithm.sigmas import flux_sigmas
from chunk_grpo.cli import profile
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.data.prompts import load_prompts
from chunk_grpo.models import FluxPolicy


def test_profile_cli(tiny_flux, tmp_path, capsys):
    model = tiny_flux
    out = tmp_path / "prof"
    layout = profile.main(["--model.name", str(model), "--chunks.profile_prompts", "3",
                           "--sampling.steps", "8", "--sampling.sde_window", "0",
                           "--run.device", "cpu", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "proposed chunks: " + ",".join(map(str, layout.sizes)) in printed
    assert layout.num_trained == 7 and max(layout.sizes) <= 5
    saved = json.loads((out / "profile.json").read_text())
    assert len(saved["l1rel"]) == 8 and saved["chunks"] == list(layout.sizes)
    assert Image.open(out / "profile.png").size == (720, 434)  # plot and a one-entry legend


def test_profile_proposes_the_chunks_a_training_config_would_use(tiny_flux, tmp_path, capsys):
    """--config and the train flags: the config's steps, SDE window, prompts and chunk size, the
    same layout the trainer's "auto" measures (`propose_chunks` of `measure_dynamics`)."""
    model = tiny_flux
    preset = tmp_path / "run.yaml"
    preset.write_text(f"model: {{name: {model}}}\nsampling: {{steps: 7, sde_window: 5}}\n"
                      "chunks: {max_size: 2, profile_prompts: 2}\ndata: {train_prompts: "
                      "shapes:train}\nrun: {seed: 3, device: cpu}\n")
    layout = profile.main(["--config", str(preset), "--out", str(tmp_path / "p")])
    policy = FluxPolicy.from_pretrained(model)
    curve = measure_dynamics(policy, load_prompts("shapes:train")[:2], num_steps=7, shift=3.0,
                             seed=3)
    expected = propose_chunks(curve, 2, 5)
    assert list(layout.sizes) == list(expected.sizes) and sum(layout.sizes) == 5
    assert max(layout.sizes) <= 2
    printed = capsys.readouterr().out
    assert printed.count("(not trained)") == 2  # steps 5 and 6: beyond the SDE window


@pytest.mark.parametrize("args, message", [
    (["--chunks.max_size", "0"], "chunks.max_size must be >= 1, got 0"),
    (["--sampling.steps", "1"], "sampling.steps must be >= 2"),
    (["--chunks.profile_prompts", "x"], "chunks.profile_prompts must be an int, got 'x'"),
    (["--num-steps", "8"], "did you mean 'sampling.steps'"),
    (["--max-chunk-size", "3"], "did you mean 'chunks.max_size'"),
    (["--prompts", "3"], "did you mean 'chunks.profile_prompts'"),
    (["--prompts-file", "p.txt"], "did you mean 'data.train_prompts'"),
])
def test_bad_settings_are_one_line_errors_naming_the_key(tmp_path, args, message):
    with pytest.raises(ConfigError) as err:
        profile.main([*args, "--out", str(tmp_path / "p")])
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "p").exists()


def test_measure_dynamics_is_the_mean_relative_change(tiny_flux, tmp_path):
    policy = FluxPolicy.from_pretrained(tiny_flux)
    prompts = ["a red circle", "two blue squares", "one green triangle"]
    curve = measure_dynamics(policy, prompts, num_steps=4, shift=3.0, batch_size=2)
    # The same trajectories sampled in one batch, then the formula.
    g = torch.Generator().manual_seed(0)
    x = policy.initial_noise(2, g).float()
    emb = policy.encode_prompts(prompts[:2])
    lat_a = denoise(policy, x, emb, flux_sigmas(4, 3.0), sampler="ode", eta=0.0, cfg_scale=1.0,
                    generator=g, keep=True).latents
    x = policy.initial_noise(1, g).float()
    emb = policy.encode_prompts(prompts[2:])
    lat_b = denoise(policy, x, emb, flux_sigmas(4, 3.0), sampler="ode", eta=0.0, cfg_scale=1.0,
                    generator=g, keep=True).latents
    want = relative_change(torch.cat([lat_a, lat_b]))
    torch.testing.assert_close(curve, want, rtol=1e-5, atol=1e-6)
    assert bool((curve > 0).all())
