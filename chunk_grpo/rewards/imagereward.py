"""The `imagereward` reward: ImageReward (Xu et al., NeurIPS 2023), a BLIP fine-tuned on 137k
expert comparisons of text-to-image outputs; one of Flow-GRPO's rewards.

Model: BLIP with a ViT-L/16 image encoder at 224x224 and a BERT-base text encoder whose layers
cross-attend to the image tokens (BLIP's "med" config). The prompt goes through the text encoder
with the image; its first position's output (768-d) goes through an MLP head (no activations,
as published; dropouts inactive at eval):

    Linear(768, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2), Linear(128, 64),
    Dropout(0.1), Linear(64, 16), Linear(16, 1)

    score = (head(text_encoder(prompt, image)[:, 0]) - 0.16717362830052426) / 1.0333394966054072

Weights: ImageReward.pt and med_config.json of the hub repo THUDM/ImageReward, converted into
transformers' BlipVisionModel + BlipTextModel (`blip_convert`). Scored as the authors'
`ImageReward.score` does:
- the tokenizer is bert-base-uncased with BLIP's added tokens [DEC] (bos) and [ENC] (30524
  tokens, the text embedding's size); prompts padded to and truncated at 35 tokens. The first
  token stays [CLS]: the authors' scoring feeds the tokenizer's output unchanged (BLIP's own ITM
  head swaps in [ENC]; ImageReward's training and scoring do not);
- images: rounded to 8 bits, shortest side to 224 (PIL's bicubic, exactly), centre crop 224
  (torchvision's offset), OpenAI CLIP's mean/std;
- the image tokens are all attended to (mask of ones), the prompt's padding is masked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from chunk_grpo.rewards.blip_convert import (
    BlipConversionError,
    split_image_reward_state_dict,
    text_model_from_state,
    vision_model_from_state,
)
from chunk_grpo.rewards.image_preprocess import ImagePreprocess
from chunk_grpo.rewards.model_files import (
    check_batch_size,
    first_line,
    load_state_dict_file,
    resolve_device_dtype,
    resolve_model_dir,
    resolve_model_file,
    reward_inputs,
)
from chunk_grpo.rewards.registry import RewardLoadError, register_reward
from chunk_grpo.rewards.score_mlp import ScoreMLP

IMAGEREWARD_REPO = "THUDM/ImageReward"
CHECKPOINT_FILE = "ImageReward.pt"
MED_CONFIG_FILE = "med_config.json"
BERT_TOKENIZER = "google-bert/bert-base-uncased"  # the hub's id of bert-base-uncased
BLIP_ADDED_TOKENS = {"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]}
MAX_LENGTH = 35
VIT_L_HEADS = 16  # BLIP's ViT-L (width 1024, head width 64); not recorded in a state dict
REWARD_MEAN = 0.16717362830052426  # the authors' normalisation of the head's output
REWARD_STD = 1.0333394966054072
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_NAME = "imagereward"


def imagereward_preprocess(image_size: int = 224) -> ImagePreprocess:
    """The authors' transform (torchvision on PIL images): Resize(size, bicubic) of the
    shortest side, CenterCrop(size) (offset round((h - size) / 2)), OpenAI CLIP mean/std."""
    return ImagePreprocess(shortest_edge=image_size, resize_to=None,
                           crop=(image_size, image_size), mode="bicubic", mean=CLIP_MEAN,
                           std=CLIP_STD, crop_rounding="round")


ImageRewardHead = ScoreMLP  # ImageReward's head: the shared published MLP (`score_mlp`)


def _load_med_config(path: Path) -> dict:
    try:
        med = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RewardLoadError(f"reward {_NAME!r}: cannot read the med config {path}: "
                              f"{first_line(err)}") from None
    if not isinstance(med, dict):
        raise RewardLoadError(f"reward {_NAME!r}: {path} is not a BERT config (a JSON object)")
    return med


def load_blip_tokenizer(name: str | os.PathLike, vocab_size: int):
    """bert-base-uncased's tokenizer with BLIP's [DEC] and [ENC] added, which must then have
    exactly the text embedding's `vocab_size` tokens (BLIP sized its table from it)."""
    from transformers import AutoTokenizer

    directory = resolve_model_dir(name, _NAME)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise RewardLoadError(f"reward {_NAME!r}: cannot load the tokenizer in {directory}: "
                              f"{first_line(err)}; pass bert-base-uncased's directory") from None
    if tokenizer.cls_token_id is None or tokenizer.pad_token_id is None:
        raise RewardLoadError(f"reward {_NAME!r}: the tokenizer of {os.fspath(name)} has no "
                              f"[CLS] or [PAD] token; pass bert-base-uncased's tokenizer")
    tokenizer.add_special_tokens(BLIP_ADDED_TOKENS)
    if len(tokenizer) != vocab_size:
        raise RewardLoadError(f"reward {_NAME!r}: the tokenizer of {os.fspath(name)} has "
                              f"{len(tokenizer)} tokens with [DEC] and [ENC] but the model's "
                              f"text embedding has {vocab_size}; pass bert-base-uncased's "
                              f"tokenizer (its files are missing or belong to another model)")
    return tokenizer


def _checkpoint_and_config(model: str | os.PathLike) -> tuple[Path, Path]:
    """ImageReward.pt and med_config.json of `model`: a directory holding both, the checkpoint
    file itself (its directory then holds the config), or the hub repo in the cache."""
    local = Path(os.fspath(model)).expanduser()
    base = local.parent if local.is_file() else model
    return (resolve_model_file(model, CHECKPOINT_FILE, _NAME),
            resolve_model_file(base, MED_CONFIG_FILE, _NAME))


@register_reward(_NAME)
class ImageRewardScore:
    """ImageReward score (see the module docstring).

    model: a directory holding ImageReward.pt and med_config.json, or the hub repo
    THUDM/ImageReward in the cache. tokenizer: bert-base-uncased (directory or cached hub id).
    vision_heads: attention heads of the ViT, which a state dict does not record (ViT-L: 16).
    dtype: None = fp32 on the CPU, bf16 on CUDA (the head runs in fp32, as the authors').
    batch_size: images (with their prompts) per forward pass.
    """

    reward_name = _NAME

    def __init__(self, model: str | os.PathLike = IMAGEREWARD_REPO,
                 tokenizer: str | os.PathLike = BERT_TOKENIZER, *,
                 vision_heads: int = VIT_L_HEADS, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype | None = None, batch_size: int = 16):
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        self.batch_size = check_batch_size(batch_size)
        checkpoint, med_path = _checkpoint_and_config(model)
        med = _load_med_config(med_path)
        try:
            state = load_state_dict_file(checkpoint, _NAME)
            vision, text, head = split_image_reward_state_dict(state)
            text_model = text_model_from_state(text, med)
            vision_model = vision_model_from_state(vision, heads=vision_heads)
        except BlipConversionError as err:
            raise RewardLoadError(f"reward {_NAME!r}: {checkpoint}: {err}") from None
        if vision_model.config.hidden_size != text_model.config.encoder_hidden_size:
            raise RewardLoadError(f"reward {_NAME!r}: {checkpoint}: the text encoder attends to "
                                  f"width {text_model.config.encoder_hidden_size} but the ViT has "
                                  f"{vision_model.config.hidden_size}")
        self.head = ImageRewardHead(text_model.config.hidden_size)
        try:
            self.head.load_state_dict(head, strict=True)
        except RuntimeError as err:
            raise RewardLoadError(f"reward {_NAME!r}: {checkpoint}: the score head mlp.layers.* "
                                  f"does not fit the published MLP: {first_line(err)}") from None
        self.tokenizer = load_blip_tokenizer(tokenizer, text_model.config.vocab_size)
        self.preprocess = imagereward_preprocess(vision_model.config.image_size)
        self.max_length = min(MAX_LENGTH, text_model.config.max_position_embeddings)
        self.vision = vision_model.to(self.device, self.dtype).requires_grad_(False)
        self.text = text_model.to(self.device, self.dtype).requires_grad_(False)
        self.head = self.head.to(self.device).eval().requires_grad_(False)

    @torch.inference_mode()
    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        images, prompts = reward_inputs(images, prompts)
        scores = [self._score_batch(images[start:start + self.batch_size],
                                    prompts[start:start + self.batch_size])
                  for start in range(0, len(prompts), self.batch_size)]
        return torch.cat(scores) if scores else torch.zeros(0)

    def _score_batch(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        pixels = self.preprocess(images.to(self.device)).to(self.dtype)
        image_tokens = self.vision(pixel_values=pixels).last_hidden_state
        tokens = self.tokenizer(prompts, padding="max_length", truncation=True,
                                max_length=self.max_length, return_tensors="pt").to(self.device)
        image_mask = torch.ones(image_tokens.shape[:-1], dtype=torch.long, device=self.device)
        text = self.text(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                         encoder_hidden_states=image_tokens, encoder_attention_mask=image_mask,
                         is_decoder=False).last_hidden_state
        rewards = self.head(text[:, 0, :].float()).squeeze(-1)
        return ((rewards - REWARD_MEAN) / REWARD_STD).cpu()
