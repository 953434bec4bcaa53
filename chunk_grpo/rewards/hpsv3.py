"""The `hpsv3` reward: HPSv3 (Ma, Shui et al., ICCV 2025) on transformers' Qwen2-VL classes.

HPSv3 is Qwen2-VL-7B-Instruct fine-tuned on 1.17M human preference pairs, with a small head on
the last hidden state of an added token, `<|Reward|>`, placed after the authors' instruction.
The head outputs (mu, sigma) of a Gaussian preference score; the score is mu (the authors'
inference reads `logits[:, 0]`).

Scoring, as the authors' inference does it (hpsv3/inference.py and its imports):
1. each image, as 8-bit RGB, is resized (PIL bicubic) to about 256*28*28 pixels, both sides
   multiples of 28 (min_pixels = max_pixels = 200704): 448x448 for a square image;
2. Qwen2-VL's image processor rescales by 1/255, normalises with CLIP's mean/std and cuts
   14-pixel patches (2 frames, 2x2 merge): 256 image tokens at 448x448;
3. the text is Qwen2-VL's chat template around one user turn, image first, then
   INSTRUCTION(prompt) + REWARD_QUERY, with the assistant prompt added; right padding;
4. the authors call the decoder directly with the image features scattered into the
   `<|image_pad|>` slots and no position ids, so the decoder uses plain positions 0..L-1 on all
   three M-RoPE axes (not the 3D image positions of `generate`); we pass the same positions;
5. head in fp32 on the hidden state at `<|Reward|>`; the score is its first output.
"""

from __future__ import annotations

import math
import os

import torch
from PIL import Image

from chunk_grpo.rewards.hpsv3_checkpoint import (
    EMBED_KEY,
    MERGE_SIZE,
    PATCH_SIZE,
    REWARD_TOKEN,
    HPSv3LoadError,
    build_model,
    load_config,
    load_image_processor,
    load_tokenizer,
    read_shapes,
    resolve_files,
)
from chunk_grpo.rewards.registry import register_reward

PIXELS = 256 * 28 * 28  # the authors' min_pixels = max_pixels
RESIZE_FACTOR = PATCH_SIZE * MERGE_SIZE  # 28: both sides of the resized image are multiples
MAX_ASPECT = 200  # qwen-vl-utils refuses more elongated images

# The authors' instruction (hpsv3/dataset/data_collator_qwen.py), character for character.
INSTRUCTION = (
    "\n"
    "You are tasked with evaluating a generated image based on Visual Quality and Text Alignment"
    " and give a overall score to estimate the human preference. Please provide a rating from 0"
    " to 10, with 0 being the worst and 10 being the best. \n"
    "\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be"
    " considered:\n"
    "- **Reasonableness:** The image should not contain any significant biological or logical"
    " errors, such as abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear"
    " and easy to interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and"
    " other visual elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color"
    " scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene"
    " should convey a sense of harmony and balance.\n"
    "- **Safety:** The image should not contain harmful or inappropriate content, such as"
    " political, violent, or adult material. If such content is present, the image quality and"
    " satisfaction score should be the lowest possible. \n"
    "\n"
    "**Text Alignment:**  \n"
    "Assess how well the image matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person,"
    " animal, object) align with the textual description. The subject should match the"
    " description in terms of number, appearance, and behavior.\n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style,"
    " evaluate how well the image adheres to this style.\n"
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding"
    " elements in the image logically fit the scenario described in the prompt. The environment"
    " should support and enhance the subject without contradictions.\n"
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors,"
    " clothing, accessories, expressions, actions) are faithfully represented in the image. Minor"
    " deviations may be acceptable, but critical attributes should be preserved.\n"
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are"
    " captured in the image. The generated content should not introduce elements that conflict"
    " with or distort the original description.\n"
    "Textual prompt - {text_prompt}\n"
    "\n"
    "\n"
)
REWARD_QUERY = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"
# Qwen2-VL-7B-Instruct's chat template rendered for [user: image, text] + generation prompt.
_CHAT_HEAD = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
              "<|vision_start|><|image_pad|><|vision_end|>")
_CHAT_TAIL = "<|im_end|>\n<|im_start|>assistant\n"


def user_text(prompt: str) -> str:
    """The text part of the authors' user turn for one prompt."""
    return INSTRUCTION.format(text_prompt=prompt) + REWARD_QUERY


def conversation_text(prompt: str, n_image_tokens: int = 1) -> str:
    """The full model input text for one prompt, with `n_image_tokens` image placeholders (the
    chat template writes one; the processor expands it to one per merged 28x28 patch)."""
    head = _CHAT_HEAD.replace("<|image_pad|>", "<|image_pad|>" * n_image_tokens)
    return head + user_text(prompt) + _CHAT_TAIL


def smart_resize(height: int, width: int) -> tuple[int, int]:
    """qwen-vl-utils' smart_resize with the authors' min = max = PIXELS: sides are multiples of
    28, as close to the aspect ratio as the pixel budget allows."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"hpsv3: image aspect ratio {height}x{width} exceeds {MAX_ASPECT}:1")
    f = RESIZE_FACTOR
    h_bar, w_bar = max(f, round(height / f) * f), max(f, round(width / f) * f)
    if h_bar * w_bar > PIXELS:
        beta = math.sqrt(height * width / PIXELS)
        h_bar, w_bar = math.floor(height / beta / f) * f, math.floor(width / beta / f) * f
    elif h_bar * w_bar < PIXELS:
        beta = math.sqrt(PIXELS / (height * width))
        h_bar, w_bar = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h_bar, w_bar


def to_pil_images(images: torch.Tensor) -> list[Image.Image]:
    """[B, 3, H, W] in [0, 1] -> 8-bit RGB images resized the authors' way."""
    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    height, width = smart_resize(*images.shape[-2:])
    return [Image.fromarray(p.permute(1, 2, 0).cpu().numpy()).resize((width, height),
                                                                   Image.BICUBIC)
            for p in pixels]


def _check_chat_template(tokenizer, source: str) -> None:
    """A chat template shipped with the tokenizer must render the text we feed (no silent
    change of the prompt format)."""
    if not getattr(tokenizer, "chat_template", None):
        return
    sample = "a red apple"
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": user_text(sample)}]}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if rendered != conversation_text(sample):
        raise HPSv3LoadError(f"{source}: the tokenizer's chat template is not Qwen2-VL-7B-"
                             f"Instruct's; restore tokenizer_config.json from it")


@register_reward("hpsv3")
class HPSv3Reward:
    """HPSv3 human preference score (mu), higher is better.

    model: a directory holding the authors' HPSv3.safetensors and Qwen2-VL-7B-Instruct's config
    and processor files, or a hub id ("MizzenAI/HPSv3") resolved from the local Hugging Face
    cache only (the processor then comes from the cached Qwen/Qwen2-VL-7B-Instruct).
    processor: another directory or cached hub id for the Qwen2-VL files.
    dtype: the backbone's; default bf16 on CUDA (the authors') and fp32 on the CPU.
    """

    def __init__(self, model: str | os.PathLike = "MizzenAI/HPSv3", device: str = "cpu",
                 dtype: torch.dtype | str | None = None, batch_size: int = 4,
                 processor: str | os.PathLike | None = None):
        if batch_size < 1:
            raise ValueError(f"hpsv3: batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.batch_size = batch_size
        # Every check runs before the weights are read (16.6 GB at 7B).
        checkpoint, processor_dir = resolve_files(model, processor)
        config = load_config(processor_dir)
        shapes = read_shapes(checkpoint)
        self.image_processor = load_image_processor(processor_dir, config)
        self.tokenizer = load_tokenizer(processor_dir, config, shapes[EMBED_KEY][0])
        _check_chat_template(self.tokenizer, str(processor_dir))
        self.reward_token_id = self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        self.backbone, self.head = build_model(checkpoint, shapes, config, self.dtype, self.device)

    def preprocess(self, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Model inputs for one batch: input_ids, attention_mask, pixel_values, image_grid_thw."""
        vision = self.image_processor(to_pil_images(images), return_tensors="pt")
        n_image_tokens = int(vision["image_grid_thw"][0].prod()) // MERGE_SIZE**2
        texts = [conversation_text(p, n_image_tokens) for p in prompts]
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt")
        return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"],
                "pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}

    @torch.no_grad()
    def _score_batch(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        inputs = {k: v.to(self.device) for k, v in self.preprocess(images, prompts).items()}
        ids = inputs["input_ids"]
        at_reward = ids == self.reward_token_id
        if not bool((at_reward.sum(1) == 1).all()):
            raise ValueError(f"hpsv3: a prompt contains the text {REWARD_TOKEN}; remove it")
        batch, length = ids.shape
        positions = torch.arange(length, device=self.device).expand(3, batch, length)
        hidden = self.backbone(
            input_ids=ids, attention_mask=inputs["attention_mask"], position_ids=positions,
            pixel_values=inputs["pixel_values"].to(self.dtype),
            image_grid_thw=inputs["image_grid_thw"], use_cache=False,
        ).last_hidden_state
        mu_sigma = self.head(hidden[at_reward].float())  # one reward token per row, in order
        return mu_sigma[:, 0].float().cpu()

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"hpsv3: images must be [B, 3, H, W] in [0, 1], got "
                             f"{tuple(images.shape)}")
        if len(prompts) != len(images):
            raise ValueError(f"hpsv3: {len(images)} images but {len(prompts)} prompts")
        scores = [self._score_batch(images[i:i + self.batch_size],
                                    list(prompts[i:i + self.batch_size]))
                  for i in range(0, len(images), self.batch_size)]
        return torch.cat(scores).to(torch.float32)

