"""The `pickscore` reward: PickScore v1 (Kirstain et al. 2023, "Pick-a-Pic"), a CLIP-H/14
fine-tuned on human preferences between generated images.

Scored as its authors do: the image processor and tokenizer of the base model
laion/CLIP-ViT-H-14-laion2B-s32B-b79K (224x224, bicubic shortest-side resize, centre crop,
OpenAI CLIP mean/std; prompts truncated to 77 tokens), the model yuvalkirstain/PickScore_v1, and

    score = exp(logit_scale) * cos(image embedding, text embedding)    (logit_scale.exp() ~ 100)

The authors' processor is transformers' CLIPProcessor on PIL images: prompts go to its
tokenizer.json tokenizer uncleaned (NFC, whitespace, lowercase only: no ftfy, no HTML
unescaping), images are rounded to 8 bits, PIL-resized and cropped at (h - 224) // 2.
"""

from __future__ import annotations

import os

import torch

from chunk_grpo.rewards.clip_score import ClipScore
from chunk_grpo.rewards.registry import register_reward

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


@register_reward("pickscore")
class PickScore(ClipScore):
    """PickScore: `model` = the PickScore_v1 CLIPModel, `processor` = CLIP-ViT-H-14's processor
    (each a local directory or a hub id in the local cache)."""

    reward_name = "pickscore"
    clean_text = None  # CLIPProcessor's tokenizer: no cleaning
    crop_rounding = "floor"  # transformers' center_crop

    def __init__(self, model: str | os.PathLike = PICKSCORE_MODEL,
                 processor: str | os.PathLike | None = PICKSCORE_PROCESSOR, *,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                 batch_size: int = 16):
        super().__init__(model, processor, device=device, dtype=dtype, batch_size=batch_size)
