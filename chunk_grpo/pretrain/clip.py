"""Pretrain a tiny CLIP on the shapes world: `python -m chunk_grpo.pretrain_clip --out DIR`.

The result is a transformers CLIPModel directory (weights, the CLIP BPE tokenizer of the tiny FLUX,
a CLIPImageProcessor config) that a generic CLIP-score reward loads like a real checkpoint.

Each step renders fresh scenes from the grammar (split "all": RL prompts contain the held-out
colour+shape pairs, so the reward must know them) and trains with the symmetric InfoNCE loss:
- image->text: each image against every distinct caption of the batch, including K captions of
  each scene with one attribute changed (hard negatives: see chunk_grpo.shapes.contrastive);
- text->image: each true caption against the batch's images.
A caption that also describes another image of the batch (the same prompt drawn twice) is never
that image's negative. Images are augmented (blur, noise, a shift of a few pixels, slight colour
gain) so the reward transfers to the tiny FLUX's soft-edged samples.

Deterministic from `--seed` for a fixed `--threads`. `--minutes` is a safety cap only: a run it
cuts short says so and is no longer a function of the seed alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass

# Idle OpenMP threads must sleep, not spin (shared CPU); set before torch starts its pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel  # noqa: E402

from chunk_grpo.config.errors import ConfigError  # noqa: E402
from chunk_grpo.models.tiny import build_clip_tokenizer  # noqa: E402
from chunk_grpo.pretrain.clip_eval import (  # noqa: E402
    embed_images,
    embed_texts,
    evaluate_clip,
    heldout_batch,
    load_clip,
    normalize_pixels,
    retrieval_accuracy,
)
from chunk_grpo.pretrain.flux import IMAGE_SIZE  # noqa: E402
from chunk_grpo.shapes import VOCABULARY  # noqa: E402
from chunk_grpo.shapes.contrastive import captioned_batch  # noqa: E402

MAX_TEXT_LENGTH = 32  # longest grammar prompt: 12 words + <|startoftext|> + <|endoftext|>


@dataclass(frozen=True)
class ClipSizes:
    patch_size: int = 8
    vision_hidden: int = 96
    vision_layers: int = 4
    vision_heads: int = 4
    vision_intermediate: int = 192
    text_hidden: int = 96
    text_layers: int = 2
    text_heads: int = 4
    text_intermediate: int = 192
    projection_dim: int = 96


SIZES = {
    "shipped": ClipSizes(),
    # Unit tests: builds and steps in milliseconds.
    "test": ClipSizes(16, 32, 1, 2, 64, 32, 1, 2, 64, 32),
}


def parse_args(argv: list[str] | None = None,
               prog: str = "python -m chunk_grpo.pretrain_clip") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output CLIP directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=600, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=64, help="images per step")
    p.add_argument("--negatives", type=int, default=4, help="one-attribute changes per image")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--size", choices=sorted(SIZES), default="shipped", help="model sizes")
    p.add_argument("--eval-every", type=int, default=200, help="held-out retrieval every k steps")
    p.add_argument("--eval-renders", type=int, default=256, help="held-out renders while training")
    p.add_argument("--final-renders", type=int, default=1024, help="held-out renders at the end")
    p.add_argument("--minutes", type=float, default=0.0, help="stop (and say so) after M minutes")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "negatives", "threads", "eval_renders", "final_renders"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_size < 2:
        raise ConfigError("--batch-size must be >= 2 (contrastive learning needs negatives)")
    if args.minutes < 0:
        raise ConfigError(f"--minutes must be >= 0 (0 = no cap), got {args.minutes}")
    return args


def build_clip(tokenizer, sizes: ClipSizes, seed: int) -> CLIPModel:
    """A randomly initialised CLIPModel for IMAGE_SIZE images and `tokenizer`'s vocabulary."""
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=sizes.text_hidden,
            intermediate_size=sizes.text_intermediate,
            num_hidden_layers=sizes.text_layers,
            num_attention_heads=sizes.text_heads,
            max_position_embeddings=MAX_TEXT_LENGTH,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            image_size=IMAGE_SIZE,
            patch_size=sizes.patch_size,
            hidden_size=sizes.vision_hidden,
            intermediate_size=sizes.vision_intermediate,
            num_hidden_layers=sizes.vision_layers,
            num_attention_heads=sizes.vision_heads,
        ),
        projection_dim=sizes.projection_dim,
    )
    model = CLIPModel(config)
    _sincos_position_init(model)
    return model


@torch.no_grad()
def _sincos_position_init(model: CLIPModel) -> None:
    """Start the patch position embeddings at a 2D sine-cosine code of unit scale. CLIP's default
    (std 0.02) is drowned by a shape patch's content, and on this world the model then learns
    colour, shape, size and count but not left/right/above/below; a code whose lowest frequency
    separates the halves of the canvas gives position from the first step. Still learned."""
    table = model.vision_model.embeddings.position_embedding.weight  # [1 + grid^2, width]
    width = table.shape[1]
    grid = math.isqrt(table.shape[0] - 1)
    ys, xs = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    quarter = width // 4
    # Periods from 2 grids down to a quarter grid: cos at the lowest says which half.
    frequencies = torch.pi / grid * 2.0 ** (3 * torch.arange(quarter).float() / quarter)
    codes = []
    for coordinate in (xs.flatten().float() + 0.5, ys.flatten().float() + 0.5):
        angle = coordinate[:, None] * frequencies[None, :]
        codes += [torch.sin(angle), torch.cos(angle)]
    code = torch.cat(codes, dim=1)
    table.zero_()
    table[1:, : code.shape[1]] = code  # the class token's row stays 0


def pixel_statistics(seed: int, count: int = 1024) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of rendered scenes (rounded): the normalisation to train with."""
    images = captioned_batch(np.random.default_rng(seed), count, negatives=1).images / 255.0
    mean = images.mean(axis=(0, 1, 2))
    std = images.std(axis=(0, 1, 2))
    return [round(float(m), 4) for m in mean], [round(float(s), 4) for s in std]


def image_processor(mean: list[float], std: list[float]) -> CLIPImageProcessor:
    """The preprocessing the model is trained with, as CLIPImageProcessor states it: at
    IMAGE_SIZE the resize and crop are identities, then x / 255, then (x - mean) / std."""
    return CLIPImageProcessor(
        do_resize=True,
        size={"shortest_edge": IMAGE_SIZE},
        resample=3,  # bicubic, for other sizes
        do_center_crop=True,
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=mean,
        image_std=std,
        do_convert_rgb=True,
    )


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[N, 3, H, W] in [0, 1] -> the same scenes as a soft, slightly noisy generator might draw
    them: a shift of up to 2 pixels, Gaussian blur (sigma up to 1.2), per-channel gain of a few
    percent, pixel noise (std up to 0.04). One image in five is left clean."""
    n, c, h, w = images.shape
    rand = lambda *shape: torch.rand(shape, generator=generator)  # noqa: E731
    # Shift: pad with the edge (background) and crop a window.
    pad = 2
    padded = F.pad(images, (pad, pad, pad, pad), mode="replicate")
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=generator).tolist()
    shifted = torch.stack([padded[i, :, dy : dy + h, dx : dx + w]
                           for i, (dy, dx) in enumerate(offsets)])
    # Blur: a separable Gaussian per image (sigma 0 = identity).
    sigma = rand(n) * 1.2
    taps = torch.arange(-3, 4, dtype=images.dtype)
    kernel = torch.exp(-0.5 * (taps[None] / sigma.clamp_min(1e-3)[:, None]) ** 2)
    kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(c, 0)  # [n*c, 7]
    flat = F.pad(shifted.reshape(1, n * c, h, w), (3, 3, 3, 3), mode="replicate")
    flat = F.conv2d(flat, kernel[:, None, None, :], groups=n * c)
    flat = F.conv2d(flat, kernel[:, None, :, None], groups=n * c)
    blurred = flat.reshape(n, c, h, w)
    gain = 1 + (rand(n, c, 1, 1) - 0.5) * 0.08
    noise = torch.randn(images.shape, generator=generator) * (rand(n, 1, 1, 1) * 0.04)
    out = (blurred * gain + noise).clamp(0, 1)
    clean = rand(n) < 0.2
    return torch.where(clean[:, None, None, None], images, out)


def contrastive_loss(model: CLIPModel, tokenizer, pixel_values: torch.Tensor,
                     captions: list[str], negatives: list[list[str]]) -> torch.Tensor:
    """Symmetric InfoNCE with the one-attribute changes as extra image->text negatives."""
    texts = sorted(set(captions) | {t for row in negatives for t in row})
    index = {t: i for i, t in enumerate(texts)}
    image_embeds = embed_images(model, pixel_values)
    text_embeds = embed_texts(model, tokenizer, texts)
    scale = model.logit_scale.exp()
    target = torch.tensor([index[c] for c in captions])
    image_to_text = F.cross_entropy(scale * image_embeds @ text_embeds.T, target)
    # Text->image over the true captions; an image with the same caption is not a negative.
    logits = scale * text_embeds[target] @ image_embeds.T
    same = target[:, None] == target[None, :]
    own = torch.eye(len(captions), dtype=torch.bool)
    logits = logits.masked_fill(same & ~own, float("-inf"))
    text_to_image = F.cross_entropy(logits, torch.arange(len(captions)))
    return (image_to_text + text_to_image) / 2


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to a tenth."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: CLIPModel, tokenizer, mean, std, args) -> dict:
    """The training loop; returns what happened (steps run, whether the time cap cut it)."""
    rng = np.random.default_rng(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=args.lr)
    held = heldout_batch(args.eval_renders)
    held_pixels = normalize_pixels(torch.from_numpy(held.images).permute(0, 3, 1, 2) / 255.0,
                                   mean, std)
    start, running, history = time.time(), None, []
    bar = tqdm(range(args.steps), desc="clip", mininterval=5)
    for step in bar:
        model.train()
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args)
        batch = captioned_batch(rng, args.batch_size, negatives=args.negatives)
        images = torch.from_numpy(batch.images).permute(0, 3, 1, 2) / 255.0
        pixels = normalize_pixels(augment(images, generator), mean, std)
        loss = contrastive_loss(model, tokenizer, pixels, batch.captions, batch.negatives)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # CLIP's cap on the temperature: a scale of at most 100
            model.logit_scale.clamp_(max=math.log(100))
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        bar.set_postfix(loss=f"{running:.3f}", refresh=False)
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            acc = retrieval_accuracy(model, tokenizer, held_pixels, held, group=32)
            history.append({"step": done, "loss": round(running, 4),
                            **{k: round(v, 4) for k, v in acc.items()}})
            tqdm.write(f"step {done}: loss {running:.3f}  held-out image->text "
                       f"{acc['image_to_text_top1']:.3f}  text->image "
                       f"{acc['text_to_image_top1']:.3f}  "
                       f"logit scale {model.logit_scale.exp().item():.1f}")
        if args.minutes and time.time() - start > 60 * args.minutes and done < args.steps:
            tqdm.write(f"stopped by --minutes {args.minutes} after {done} of {args.steps} steps: "
                       f"this run is not reproducible from its seed")
            return {"steps_run": done, "cut_by_minutes": True, "history": history}
    return {"steps_run": args.steps, "cut_by_minutes": False, "history": history}


def run(args: argparse.Namespace) -> dict:
    start, cpu_start = time.time(), time.process_time()
    tokenizer = build_clip_tokenizer(VOCABULARY)
    tokenizer.model_max_length = MAX_TEXT_LENGTH
    model = build_clip(tokenizer, SIZES[args.size], args.seed)
    mean, std = pixel_statistics(args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"CLIP with {n_params / 1e6:.2f}M parameters; pixel mean {mean} std {std}")
    outcome = train(model, tokenizer, mean, std, args)
    minutes = (time.time() - start) / 60
    cpu_minutes = (time.process_time() - cpu_start) / 60  # the budget: the machine is shared

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    image_processor(mean, std).save_pretrained(args.out)
    # The final numbers come from the saved directory, through the generic loading path.
    final = evaluate_clip(load_clip(args.out), renders=args.final_renders, group=32)
    record = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "sizes": asdict(SIZES[args.size]),
        "parameters": n_params,
        "minutes": round(minutes, 2),
        "cpu_minutes": round(cpu_minutes, 2),
        "steps_run": outcome["steps_run"],
        "cut_by_minutes": outcome["cut_by_minutes"],
        "final_heldout": final,
        "history": outcome["history"],
    }
    (args.out / "pretrain_clip.json").write_text(json.dumps(record, indent=2) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file()) / 2**20
    print(f"held-out ({args.final_renders} renders): image->text top-1 "
          f"{final['image_to_text_top1']:.3f} vs {final['negatives_per_image']} one-attribute "
          f"changes, text->image top-1 {final['text_to_image_top1']:.3f} in groups of 32")
    print(f"saved {args.out} ({size:.1f} MB) in {minutes:.1f} min ({cpu_minutes:.1f} CPU-min)")
    return record
