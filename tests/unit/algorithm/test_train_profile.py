"""`python -m chunk_grpo.profile`: the temporal-dynamics curve, proposed chunks, a PNG plot."""

import json

import torch
from PIL import Image

from chunk_grpo.algorithm.chunking import relative_change
from chunk_grpo.algorithm.dynamics import measure_dynamics
from chunk_grpo.algorithm.rollout import denoise
from chunk_grpo.algorithm.sigmas import flux_sigmas
from chunk_grpo.cli import profile
from chunk_grpo.models import FluxPolicy


def test_profile_cli(tiny_flux, tmp_path, capsys):
    model = tiny_flux
    out = tmp_path / "prof"
    layout = profile.main(["--model.name", str(model), "--prompts", "3", "--sampling.steps", "8",
                           "--out", str(out)])
    printed = capsys.readouterr().out
    assert "proposed chunks: " + ",".join(map(str, layout.sizes)) in printed
    assert layout.num_trained == 7 and max(layout.sizes) <= 5
    saved = json.loads((out / "profile.json").read_text())
    assert len(saved["l1rel"]) == 8 and saved["chunks"] == list(layout.sizes)
    assert Image.open(out / "profile.png").size == (720, 434)  # plot and a one-entry legend


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
