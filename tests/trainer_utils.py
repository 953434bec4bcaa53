"""Shared pieces of the tests: THE tiny random FLUX every test loads (saved to disk; the
`tiny_flux` fixtures of conftest.py build it once per test run), toy rewards registered for a
test's duration, a trainer config."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from chunk_grpo.config.parsing import build_config
from chunk_grpo.models import SamplingDefaults
from chunk_grpo.models.tiny import build_tiny_flux_pipeline
from chunk_grpo.rewards import available_rewards, register_reward, unregister_reward
from chunk_grpo.shapes import VOCABULARY

TINY_SIZES = dict(num_layers=1, num_single_layers=1, num_attention_heads=2,
                  attention_head_dim=16, axes_dims_rope=(4, 6, 6))
TINY_DEFAULTS = SamplingDefaults(height=32, width=32, max_sequence_length=8, num_steps=5,
                                 shift=3.0)


def save_tiny_flux(directory: Path, vocabulary: list[str], *, seed: int = 0,
                   defaults: SamplingDefaults = TINY_DEFAULTS, **sizes) -> Path:
    """A random tiny FLUX over ``vocabulary`` (TINY_SIZES unless sizes are given) saved with its
    sampling defaults in ``directory``, which `FluxPolicy.from_pretrained` loads."""
    build_tiny_flux_pipeline(vocabulary, seed=seed, **(sizes or TINY_SIZES)).save_pretrained(
        directory)
    defaults.save(directory)
    return Path(directory)


def tiny_model_dir(root: Path, seed: int = 0) -> Path:
    """A random tiny FLUX with the shapes vocabulary (32x32 images, 16 latent tokens of 16
    channels) and TINY_DEFAULTS saved as a diffusers directory; built once per root and seed.
    Tests take it from the session fixtures `tiny_flux` / `tiny_flux_seed` instead of building
    their own."""
    path = root / f"tiny-flux-{seed}"
    if not path.exists():
        pipe = build_tiny_flux_pipeline(VOCABULARY, seed=seed, **TINY_SIZES)
        pipe.save_pretrained(path)
        TINY_DEFAULTS.save(path)
    return path


class Brightness:
    """Toy reward: mean pixel value (the trainer should learn to brighten images)."""

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return images.float().mean(dim=(1, 2, 3))


@contextmanager
def registered_rewards(**factories: Callable) -> Iterator[None]:
    """The rewards ``name=factory`` registered inside the block and unregistered after it, so a
    test sees exactly the toy rewards it asked for, whatever ran before it."""
    done = []
    try:
        for name, factory in factories.items():
            fresh = name not in available_rewards()
            register_reward(name)(factory)  # refuses a name taken by another factory
            if fresh:  # an enclosing block registered it already: it unregisters it
                done.append(name)
        yield
    finally:
        for name in done:
            unregister_reward(name)


def tiny_config(model_dir: Path, out_dir: Path, overrides: dict | None = None):
    """A config of two tiny iterations on ``model_dir``, with ``overrides`` ({dotted key: value})
    applied."""
    values = {"model.name": str(model_dir), "reward.name": "test_brightness",
              "run.output_dir": str(out_dir), "sampling.steps": 5, "sampling.group_size": 4,
              "sampling.prompts_per_step": 2, "optim.micro_batch_size": 4,
              "sampling.batch_size": 8, "chunks.spec": "2,2", "run.max_steps": 2,
              "eval.images": 4, "eval.final_images": 4, "run.image_grid_every": 0,
              "run.progress": False, "sampling.eta": 0.7, "optim.lr": 1e-3,
              "eval.hybrid_steps": 0, "run.max_minutes": 0, "eval.every": 0,
              "run.checkpoint_every": 0,
              # the mechanics under test: full fine-tuning, every step stochastic
              "model.lora_rank": 0, "sampling.sde_window": 0, "sampling.shared_noise": False,
              "model.mixed_precision": "no", "chunks.fraction": 0.5}
    values.update(overrides or {})
    return build_config(None, values)


def velocities(*policies) -> list[torch.Tensor]:
    """Each policy's velocity on the same two noises, prompts and sigmas (no grad), encoded by
    the first policy."""
    x = policies[0].initial_noise(2, torch.Generator().manual_seed(0))
    emb = policies[0].encode_prompts(["a red circle", "two blue squares"])
    sigma = torch.tensor([0.7, 0.4])
    with torch.no_grad():
        return [policy.velocity(x, sigma, emb) for policy in policies]


class Killed(Exception):
    """Raised by an ``on_step_end`` hook to stop a run as a crash would."""


def without_times(records: list[dict]) -> list[dict]:
    """Metrics records without their wall-time and measured-memory fields (the part a rerun
    reproduces exactly: a process's allocator peaks depend on what ran before in it)."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))}
            for r in records]
