"""How good a shapes-world CLIP is as a reward: `python -m chunk_grpo.evaluate_clip --clip DIR`.

Two measurements, both on data training never sees:
1. Retrieval on held-out renders (scenes drawn with HELDOUT_SEED, rendered cleanly):
   - image->text top-1: the true caption must outscore each of the image's captions with one
     attribute changed (colour, shape, count, size, position); also per attribute, pairwise;
   - text->image top-1: each caption must pick its own image among a group of N images.
2. The generator's images: the embedded tiny FLUX samples held-out prompts; the Spearman rank
   correlation between the CLIP score (logit scale * cosine of image and prompt embeddings) and
   the programmatic `shapes` reward on the same images says whether the learned reward tracks
   prompt fidelity on the images an RL run actually scores.

The CLIP is read the way a generic loader reads a real checkpoint: CLIPModel, the tokenizer, and
CLIPImageProcessor from the directory's preprocessor_config.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.evaluate.evaluation import evaluate_policy
from chunk_grpo.models import FluxPolicy
from chunk_grpo.shapes.contrastive import ATTRIBUTES, CaptionedBatch, captioned_batch

HELDOUT_SEED = 1_000_003  # training draws scenes from --seed's stream, never this one
SHIPPED_CLIP = Path(__file__).parents[1] / "assets" / "shapes-clip"


@dataclass
class LoadedClip:
    model: CLIPModel
    tokenizer: object
    processor: CLIPImageProcessor


def load_clip(path: str | Path) -> LoadedClip:
    """CLIPModel + tokenizer + image processor from one directory (eval mode, fp32)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{str(path)!r} is not a CLIP directory (no config.json); train one with "
                         f"`python -m chunk_grpo.pretrain_clip --out DIR`")
    model = CLIPModel.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if len(tokenizer) != model.config.text_config.vocab_size:
        raise ConfigError(f"{path}: the tokenizer has {len(tokenizer)} tokens but the text model "
                         f"{model.config.text_config.vocab_size}; save them together")
    return LoadedClip(model, tokenizer, CLIPImageProcessor.from_pretrained(path))


def normalize_pixels(images: torch.Tensor, mean, std) -> torch.Tensor:
    """[N, 3, H, W] in [0, 1] -> CLIP pixel values (what CLIPImageProcessor does at its size)."""
    mean = torch.tensor(mean, dtype=images.dtype).view(1, 3, 1, 1)
    std = torch.tensor(std, dtype=images.dtype).view(1, 3, 1, 1)
    return (images - mean) / std


def embed_images(model: CLIPModel, pixel_values: torch.Tensor) -> torch.Tensor:
    """Unit-norm image embeddings [N, D], as CLIPModel.forward computes them."""
    pooled = model.vision_model(pixel_values=pixel_values).pooler_output
    return F.normalize(model.visual_projection(pooled), dim=-1)


def embed_texts(model: CLIPModel, tokenizer, texts: list[str]) -> torch.Tensor:
    """Unit-norm text embeddings [N, D], as CLIPModel.forward computes them."""
    tokens = tokenizer(texts, padding=True, return_tensors="pt")
    pooled = model.text_model(input_ids=tokens["input_ids"],
                              attention_mask=tokens["attention_mask"]).pooler_output
    return F.normalize(model.text_projection(pooled), dim=-1)


def heldout_batch(count: int, negatives: int = len(ATTRIBUTES)) -> CaptionedBatch:
    """The fixed held-out renders: same `count`, same scenes, on every call."""
    return captioned_batch(np.random.default_rng(HELDOUT_SEED), count, negatives=negatives)


@torch.no_grad()
def retrieval_accuracy(
    model: CLIPModel, tokenizer, pixel_values: torch.Tensor, batch: CaptionedBatch, group: int = 32
) -> dict[str, float]:
    """image->text top-1 against the one-attribute changes (and per attribute, pairwise), and
    text->image top-1 among groups of `group` images (a caption shared by several images in its
    group counts as right on any of them)."""
    model.eval()
    images = embed_images(model, pixel_values)
    texts = sorted({t for row in batch.negatives for t in row} | set(batch.captions))
    index = {t: i for i, t in enumerate(texts)}
    text_embeds = torch.cat([embed_texts(model, tokenizer, texts[i : i + 512])
                             for i in range(0, len(texts), 512)])
    true = text_embeds[[index[c] for c in batch.captions]]
    true_score = (images * true).sum(-1)
    wins = torch.ones(len(images), dtype=torch.bool)
    pairwise: dict[str, list[bool]] = {a: [] for a in ATTRIBUTES}
    for i, (row, attributes) in enumerate(zip(batch.negatives, batch.negative_attributes,
                                              strict=True)):
        false_score = text_embeds[[index[t] for t in row]] @ images[i]
        beaten = true_score[i] > false_score
        wins[i] = bool(beaten.all())
        for attribute, ok in zip(attributes, beaten.tolist(), strict=True):
            pairwise[attribute].append(ok)
    t2i = []
    for start in range(0, len(images) - group + 1, group):
        block = slice(start, start + group)
        best = (true[block] @ images[block].T).argmax(dim=1)
        captions = batch.captions[block]
        t2i += [captions[j] == captions[k] for j, k in enumerate(best.tolist())]
    result = {
        "image_to_text_top1": wins.float().mean().item(),
        "negatives_per_image": len(batch.negatives[0]),
        "text_to_image_top1": float(np.mean(t2i)) if t2i else float("nan"),
        "text_to_image_group": group,
    }
    for attribute, oks in pairwise.items():
        if oks:
            result[f"pairwise_{attribute}"] = float(np.mean(oks))
    return result


@torch.no_grad()
def clip_scores(clip: LoadedClip, images_uint8: np.ndarray, prompts: list[str]) -> torch.Tensor:
    """logit_scale * cosine(image, prompt) per pair, preprocessed by CLIPImageProcessor."""
    pixel_values = clip.processor(images=list(images_uint8), return_tensors="pt")["pixel_values"]
    image_embeds = embed_images(clip.model, pixel_values)
    text_embeds = embed_texts(clip.model, clip.tokenizer, prompts)
    return clip.model.logit_scale.exp() * (image_embeds * text_embeds).sum(-1)


def generator_correlation(clip: LoadedClip, model: str | Path, prompts: list[str],
                          seed: int = 0, images_per_prompt: int = 1) -> dict[str, float]:
    """Sample `images_per_prompt` images per prompt with the FLUX model at `model`; Spearman
    correlation between the CLIP score and the `shapes` reward on those images: over all images,
    and (with several images per prompt) within each prompt's group, averaged over the prompts,
    which is the ranking a group-relative advantage sees."""

    policy = FluxPolicy.from_pretrained(model)
    result = evaluate_policy(policy, prompts, reward="shapes", seed=seed,
                             images_per_prompt=images_per_prompt)
    pixels = (result.images.clamp(0, 1) * 255).round().to(torch.uint8)
    scores = clip_scores(clip, pixels.permute(0, 2, 3, 1).numpy(), result.prompts).numpy()
    rewards = result.rewards.numpy()
    rho, p_value = spearmanr(scores, rewards)
    metrics = {
        "spearman_vs_shapes": float(rho),
        "spearman_p_value": float(p_value),
        "generated_images": result.n,
        "images_per_prompt": images_per_prompt,
        "shapes_reward_mean": result.reward_mean,
        "clip_score_mean": float(scores.mean()),
    }
    if images_per_prompt > 1:
        within = []
        for s, r in zip(scores.reshape(-1, images_per_prompt),
                        rewards.reshape(-1, images_per_prompt), strict=True):
            if np.ptp(s) > 0 and np.ptp(r) > 0:  # a constant group has no ranking
                within.append(spearmanr(s, r)[0])
        metrics["spearman_within_prompt_mean"] = float(np.mean(within)) if within else math.nan
        metrics["prompts_with_a_ranking"] = len(within)
    return metrics


def evaluate_clip(clip: LoadedClip, *, renders: int, group: int) -> dict[str, float]:
    """Retrieval accuracy on `renders` held-out renders, preprocessed by the CLIP's processor."""
    batch = heldout_batch(renders)
    pixel_values = clip.processor(images=list(batch.images), return_tensors="pt")["pixel_values"]
    return retrieval_accuracy(clip.model, clip.tokenizer, pixel_values, batch, group=group)
