"""Pretrain the embedded tiny FLUX on the shapes world: the VAE, then the transformer (rectified
flow on the normalised latents), deterministic from the seed. `chunk-grpo pretrain`
(`chunk_grpo.cli.pretrain`) describes the stages and the flags.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time

# Idle OpenMP threads must sleep, not spin: on a shared 2-core machine spinning threads make
# every step several times slower. Must be set before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from pathlib import Path

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from chunk_grpo.models.latents import pack_latents  # noqa: E402
from chunk_grpo.models.policy import FluxPolicy, PromptEmbeds  # noqa: E402
from chunk_grpo.models.sampling_defaults import SamplingDefaults  # noqa: E402
from chunk_grpo.models.tiny import build_tiny_flux_pipeline  # noqa: E402
from chunk_grpo.shapes import VOCABULARY, random_scene, render_scene, scene_to_prompt  # noqa: E402

IMAGE_SIZE = 64
MAX_SEQUENCE_LENGTH = 16  # longest grammar prompt is 12 words + </s>
# Shipped model: the TinyFluxSizes transformer, a light VAE (4x down, 8 latent channels).
MODEL_SIZES = dict(latent_channels=8, vae_block_out_channels=(16, 32, 32), vae_norm_num_groups=8)


def render_dataset(count: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    """`count` training-split scenes: uint8 images [N, 3, 64, 64] and their prompts."""
    rng = np.random.default_rng(seed)
    images = np.empty((count, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    prompts = []
    for i in tqdm(range(count), desc="render scenes", mininterval=2):
        scene = random_scene(rng, split="train")
        images[i] = render_scene(scene, size=IMAGE_SIZE, rng=rng)
        prompts.append(scene_to_prompt(scene))
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), prompts


def to_unit(images_uint8: torch.Tensor) -> torch.Tensor:
    return images_uint8.float() / 255.0


def train_vae(vae, images: torch.Tensor, args, generator: torch.Generator) -> None:
    """Reconstruction (MSE in [-1, 1]) plus a small KL to keep the posterior well-behaved."""
    vae.train().requires_grad_(True)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    bar = tqdm(range(args.vae_steps), desc="vae", mininterval=5)
    for step in bar:
        lr = args.vae_lr * min(1.0, (step + 1) / 100) * (0.1 if step > 0.8 * args.vae_steps else 1)
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(len(images), (args.vae_batch_size,), generator=generator)
        x = to_unit(images[idx]) * 2 - 1
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        recon = vae.decode(z).sample
        mse = (recon - x).square().mean()
        kl = posterior.kl().mean() / x[0].numel()
        loss = mse + 1e-4 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            bar.set_postfix(psnr=f"{10 * math.log10(4 / max(mse.item(), 1e-10)):.1f}dB")
    vae.eval().requires_grad_(False)


@torch.no_grad()
def encode_latents(vae, images: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """Posterior means [N, C, h, w] (unnormalised)."""
    out = []
    for i in tqdm(range(0, len(images), batch), desc="encode latents", mininterval=5):
        x = to_unit(images[i : i + batch]) * 2 - 1
        out.append(vae.encode(x).latent_dist.mode())
    return torch.cat(out)


@torch.no_grad()
def encode_unique_prompts(policy: FluxPolicy, prompts: list[str]):
    """Encode each distinct prompt once: (embeds of the distinct prompts, index of each item)."""
    unique = sorted(set(prompts))
    position = {p: i for i, p in enumerate(unique)}
    parts = [policy.encode_prompts(unique[i : i + 512]) for i in range(0, len(unique), 512)]
    return PromptEmbeds.cat(parts), torch.tensor([position[p] for p in prompts])


def save_model(policy: FluxPolicy, ema_state: dict, out: Path, defaults: SamplingDefaults) -> None:
    live = copy.deepcopy(policy.transformer.state_dict())
    policy.transformer.load_state_dict(ema_state)
    out.mkdir(parents=True, exist_ok=True)
    policy.pipeline.save_pretrained(out)
    defaults.save(out)
    policy.transformer.load_state_dict(live)


def train_transformer(policy: FluxPolicy, latents, embeds, prompt_index, args, generator):
    """Rectified flow on packed latents; returns the EMA state dict (saved at checkpoints)."""
    transformer = policy.transformer
    transformer.train().requires_grad_(True)
    ema = {k: v.detach().clone() for k, v in transformer.state_dict().items()}
    opt = torch.optim.AdamW(transformer.parameters(), lr=args.lr, weight_decay=0.01)
    negative = policy.negative_embeds(1)
    defaults = policy.defaults
    bar = tqdm(range(args.steps), desc="transformer", mininterval=5)
    running = None
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup_steps)
        idx = torch.randint(len(latents), (args.batch_size,), generator=generator)
        x0 = pack_latents(latents[idx])
        noise = torch.randn(x0.shape, generator=generator)
        u = torch.rand(args.batch_size, generator=generator)
        sigma = args.shift * u / (1 + (args.shift - 1) * u)
        x_s = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        cond = embeds.index(prompt_index[idx])
        drop = torch.rand(args.batch_size, generator=generator) < args.caption_dropout
        cond.prompt_embeds = torch.where(
            drop[:, None, None], negative.prompt_embeds, cond.prompt_embeds
        )
        cond.pooled = torch.where(drop[:, None], negative.pooled, cond.pooled)
        v = policy.velocity(x_s, sigma, cond)
        loss = (v - (noise - x0)).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for k, p in transformer.state_dict().items():
                ema[k].lerp_(p, 1 - args.ema_decay) if p.is_floating_point() else ema[k].copy_(p)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{running:.4f}")
        done = step + 1
        if args.checkpoint_every and done % args.checkpoint_every == 0 and done < args.steps:
            save_model(policy, ema, args.out / "checkpoints" / f"step_{done:06d}", defaults)
    transformer.eval().requires_grad_(False)
    return ema


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    start = time.time()

    images, prompts = render_dataset(args.num_images, args.seed)
    pipeline = build_tiny_flux_pipeline(VOCABULARY, seed=args.seed, **MODEL_SIZES)
    defaults = SamplingDefaults(
        height=IMAGE_SIZE,
        width=IMAGE_SIZE,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        default_cfg_scale=args.cfg_scale,
        negative_prompt="",
        num_steps=16,
        shift=args.shift,
    )
    policy = FluxPolicy(pipeline, defaults)

    train_vae(pipeline.vae, images, args, generator)
    raw = encode_latents(pipeline.vae, images)
    shift_factor, scaling_factor = raw.mean().item(), 1.0 / raw.std().item()
    pipeline.vae.register_to_config(shift_factor=shift_factor, scaling_factor=scaling_factor)
    latents = (raw - shift_factor) * scaling_factor
    print(f"vae latents: shift_factor={shift_factor:.4f} scaling_factor={scaling_factor:.4f}")

    embeds, prompt_index = encode_unique_prompts(policy, prompts)
    ema = train_transformer(policy, latents, embeds, prompt_index, args, generator)
    save_model(policy, ema, args.out, defaults)
    weights = [f for f in args.out.rglob("*.safetensors") if "checkpoints" not in f.parts]
    sizes = sum(f.stat().st_size for f in weights) / 2**20
    print(f"saved {args.out} ({sizes:.1f} MB of weights) in {(time.time() - start) / 60:.1f} min")
