"""The `clip` reward: CLIP score, how well an image matches its prompt under a CLIPModel.

    score = exp(logit_scale) * cos(image embedding, text embedding)

The scale is the model's own learned temperature, the one its contrastive logits use (CLIP's
`logits_per_image`, and PickScore's score): for OpenAI's CLIP checkpoints and PickScore it is
100, so the score is the common "100 * cos" convention (torchmetrics' CLIPScore, without its
clamp at 0: a reward keeps its ordering below 0 too). Default checkpoint:
openai/clip-vit-large-patch14. The project's own `shapes-clip` is this class on its tiny CLIP.

Inputs are prepared as OpenAI's `clip` package does: prompts cleaned as its tokenizer does
(`text_clean.clip_clean`: ftfy, HTML unescaping, whitespace) and truncated to 77 tokens (what
`clip.tokenize(..., truncate=True)` gives; its default raises on a longer prompt); images rounded
to 8 bits, resized with PIL's bicubic (shortest side to 224) and centre-cropped as torchvision
does (offset round((h - 224) / 2)).
"""

from __future__ import annotations

import os

import torch

from chunk_grpo.rewards.clip_common import load_clip_encoder
from chunk_grpo.rewards.model_files import reward_inputs
from chunk_grpo.rewards.registry import register_reward
from chunk_grpo.rewards.text_clean import clip_clean

DEFAULT_CLIP = "openai/clip-vit-large-patch14"


@register_reward("clip")
class ClipScore:
    """CLIP score of images against their prompts (see the module docstring).

    model: a CLIPModel directory or a hub id in the local Hugging Face cache.
    processor: where the tokenizer and preprocessor_config.json are (default: `model`).
    dtype: None = fp32 on the CPU, bf16 on CUDA. batch_size: images (and prompts) per call.
    """

    reward_name = "clip"
    clean_text = staticmethod(clip_clean)  # OpenAI clip's tokenizer cleaning
    crop_rounding = "round"  # torchvision's CenterCrop

    def __init__(self, model: str | os.PathLike = DEFAULT_CLIP,
                 processor: str | os.PathLike | None = None, *,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                 batch_size: int = 16):
        self.encoder = load_clip_encoder(model, processor, reward=self.reward_name,
                                         device=device, dtype=dtype, batch_size=batch_size,
                                         clean_text=self.clean_text,
                                         crop_rounding=self.crop_rounding)
        self.scale = self.encoder.logit_scale

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        images, prompts = reward_inputs(images, prompts)
        image_embeds = self.encoder.encode_images(images)
        text_embeds = self.encoder.encode_prompts(prompts)
        return (self.scale * (image_embeds * text_embeds).sum(dim=-1)).float()
