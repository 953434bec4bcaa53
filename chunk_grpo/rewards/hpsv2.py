"""The `hpsv2` reward: Human Preference Score v2.1 (Wu et al. 2023), the reward of Dance-GRPO.

HPSv2.1 is open_clip's ViT-H-14 fine-tuned on human preferences (HPD v2), shipped as the open_clip
state dict HPS_v2.1_compressed.pt (hub repo xswu/HPSv2, under the key "state_dict"). It runs here
on transformers' CLIPModel after a key conversion (`open_clip_convert`), because open_clip needs
torchvision, which cannot be installed beside this project's torch.

Scored as the authors' `hpsv2.score` does:
- images: its transform is built with `light_augmentation=True`, i.e. open_clip's ResizeMaxSize:
  the 8-bit image (a PIL image there) as floats, the LONGEST side resized to 224 (torch's
  antialiased bicubic on the float tensor, not clamped; the other side round(side * scale)),
  then padded to 224x224 with black (0 before normalisation), the smaller half on the left/top;
  OpenAI CLIP mean/std. A 224x224 image is not resized. No centre crop: nothing is cut off;
- prompts: open_clip's tokenizer, i.e. `text_clean.clip_clean` (ftfy, HTML unescaping,
  whitespace) then CLIP BPE, 77 tokens (start, 75 tokens, end for a longer prompt);
- the diagonal of image_features @ text_features.T with both L2-normalised and NO logit scale:

    score = cos(image embedding, text embedding)

The tokenizer comes from laion/CLIP-ViT-H-14-laion2B-s32B-b79K (the base model's transformers
port; its BPE vocabulary is open_clip's). Its preprocessor_config.json is not read: the
transform is the one above, at the vision tower's image size.
"""

from __future__ import annotations

import os

import torch

from chunk_grpo.rewards.clip_common import ClipEncoder, load_clip_tokenizer
from chunk_grpo.rewards.image_preprocess import ImagePreprocess
from chunk_grpo.rewards.model_files import (
    check_batch_size,
    load_state_dict_file,
    resolve_device_dtype,
    resolve_model_dir,
    resolve_model_file,
    reward_inputs,
)
from chunk_grpo.rewards.open_clip_convert import OpenClipConversionError, clip_model_from_open_clip
from chunk_grpo.rewards.registry import RewardLoadError, register_reward
from chunk_grpo.rewards.text_clean import clip_clean

HPSV2_REPO = "xswu/HPSv2"
HPSV21_FILE = "HPS_v2.1_compressed.pt"
VIT_H_14_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
VIT_H_14_HEADS = (16, 16)  # vision (width 1280, head width 80), text (width 1024, 64)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # open_clip's OPENAI_DATASET_MEAN/STD
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def hpsv2_preprocess(image_size: int) -> ImagePreprocess:
    """hpsv2's validation transform (light_augmentation=True): ResizeMaxSize(image_size) on the
    float image, black padding, OpenAI CLIP mean/std."""
    return ImagePreprocess(shortest_edge=None, resize_to=None, crop=None, mode="bicubic",
                           mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, resize="float",
                           longest_edge=image_size)


@register_reward("hpsv2")
class HPSv2Score:
    """HPSv2.1 score (see the module docstring).

    model: HPS_v2.1_compressed.pt, a directory holding it, or the hub repo xswu/HPSv2 in the cache.
    processor: ViT-H-14's tokenizer (directory or cached hub id).
    heads: attention heads of the (vision, text) towers, which a state dict does not record.
    """

    def __init__(self, model: str | os.PathLike = HPSV2_REPO,
                 processor: str | os.PathLike = VIT_H_14_PROCESSOR, *,
                 heads: tuple[int, int] = VIT_H_14_HEADS, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype | None = None, batch_size: int = 16):
        device, dtype = resolve_device_dtype(device, dtype)
        check_batch_size(batch_size)
        checkpoint = resolve_model_file(model, HPSV21_FILE, "hpsv2")
        processor_dir = resolve_model_dir(processor, "hpsv2")
        state = load_state_dict_file(checkpoint, "hpsv2", "open_clip state dict")
        if "token_embedding.weight" not in state:
            raise RewardLoadError(f"reward 'hpsv2': {checkpoint} is not an open_clip CLIP "
                                  f"checkpoint (no token_embedding.weight)")
        tokenizer = load_clip_tokenizer(processor_dir, state["token_embedding.weight"].shape[0],
                                        os.fspath(processor), "hpsv2")
        try:
            clip = clip_model_from_open_clip(
                state, vision_heads=heads[0], text_heads=heads[1],
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
        except OpenClipConversionError as err:
            raise RewardLoadError(f"reward 'hpsv2': {checkpoint}: {err}") from None
        del state
        preprocess = hpsv2_preprocess(clip.config.vision_config.image_size)
        self.encoder = ClipEncoder(clip, tokenizer, preprocess, device=device, dtype=dtype,
                                   batch_size=batch_size, source=str(checkpoint),
                                   clean_text=clip_clean)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        images, prompts = reward_inputs(images, prompts)
        image_embeds = self.encoder.encode_images(images)
        text_embeds = self.encoder.encode_prompts(prompts)
        return (image_embeds * text_embeds).sum(dim=-1).float()
