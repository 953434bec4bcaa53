"""The `hpsv2` reward: Human Preference Score v2.1 (Wu et al. 2023), the reward of Dance-GRPO.

HPSv2.1 is open_clip's ViT-H-14 fine-tuned on human preferences (HPD v2), shipped as the open_clip
state dict HPS_v2.1_compressed.pt (hub repo xswu/HPSv2, under the key "state_dict"). It runs here
on transformers' CLIPModel after a key conversion (`open_clip_convert`), because open_clip needs
torchvision, which cannot be installed beside this project's torch.

Scored as the authors' `hpsv2.score` does: open_clip's validation transform (shortest side to 224
bicubic, centre crop 224, OpenAI CLIP mean/std), the ViT-H-14 tokenizer (CLIP BPE, 77 tokens),
and the diagonal of image_features @ text_features.T with both L2-normalised and NO logit scale:

    score = cos(image embedding, text embedding)

The tokenizer and preprocessor_config.json come from laion/CLIP-ViT-H-14-laion2B-s32B-b79K
(the base model's transformers port; its tokenizer and transform are open_clip's for ViT-H-14).
"""

from __future__ import annotations

import os

import torch

from chunk_grpo.rewards.clip_common import ClipEncoder, check_image_size, load_clip_tokenizer
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

HPSV2_REPO = "xswu/HPSv2"
HPSV21_FILE = "HPS_v2.1_compressed.pt"
VIT_H_14_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
VIT_H_14_HEADS = (16, 16)  # vision (width 1280, head width 80), text (width 1024, 64)


@register_reward("hpsv2")
class HPSv2Score:
    """HPSv2.1 score (see the module docstring).

    model: HPS_v2.1_compressed.pt, a directory holding it, or the hub repo xswu/HPSv2 in the cache.
    processor: ViT-H-14's tokenizer + preprocessor_config.json (directory or cached hub id).
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
        preprocess = ImagePreprocess.load(processor_dir, "hpsv2")
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
        check_image_size(preprocess, clip.config.vision_config.image_size, str(checkpoint),
                         "hpsv2")
        self.encoder = ClipEncoder(clip, tokenizer, preprocess, device=device, dtype=dtype,
                                   batch_size=batch_size, source=str(checkpoint))

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        images, prompts = reward_inputs(images, prompts)
        image_embeds = self.encoder.encode_images(images)
        text_embeds = self.encoder.encode_prompts(prompts)
        return (image_embeds * text_embeds).sum(dim=-1).float()
