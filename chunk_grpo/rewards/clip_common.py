"""What every CLIP-based reward shares: load a CLIPModel with its tokenizer and image preprocessing,
check they fit, and encode images and prompts in batches into unit vectors.

Used by `clip`, `pickscore`, `aesthetic` and `hpsv2` (whose open_clip weights are converted
into a CLIPModel first). Works for any CLIPModel checkpoint: any image size, patch size, width,
and a CLIPTokenizer or CLIPTokenizerFast.

transformers' model classes are imported when a reward is built, not when the registry is: they
cost seconds of CPU at every start of every command, most of which use no CLIP reward.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from chunk_grpo.rewards.image_preprocess import ImagePreprocess
from chunk_grpo.rewards.model_files import (
    check_batch_size,
    check_vocabulary,
    first_line,
    resolve_device_dtype,
    resolve_model_dir,
)
from chunk_grpo.rewards.registry import RewardLoadError

if TYPE_CHECKING:
    from transformers import CLIPModel


def _features(output) -> torch.Tensor:
    """transformers 5 returns a model output whose pooler_output is the projected embedding;
    4.x returns the tensor itself."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class ClipEncoder:
    """A CLIPModel, its tokenizer and its preprocessing; encodes to float32 unit vectors (CPU)."""

    def __init__(self, model: CLIPModel, tokenizer, preprocess: ImagePreprocess, *,
                 device: torch.device, dtype: torch.dtype, batch_size: int, source: str,
                 clean_text: Callable[[str], str] | None = None):
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.clean_text = clean_text  # the authors' prompt cleaning before BPE (text_clean)
        self.preprocess = preprocess
        self.device, self.dtype = device, dtype
        self.batch_size = check_batch_size(batch_size)
        self.source = source
        text_config = model.config.text_config
        self.max_length = min(int(tokenizer.model_max_length),
                              int(text_config.max_position_embeddings))

    @property
    def logit_scale(self) -> float:
        """The model's learned temperature exp(logit_scale): 100 for OpenAI CLIP and PickScore."""
        return float(self.model.logit_scale.float().exp())

    @torch.inference_mode()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Unit image embeddings [B, E] of float images [B, 3, H, W] in [0, 1]."""
        out = []
        for batch in images.split(self.batch_size):
            pixels = self.preprocess(batch.to(self.device)).to(self.dtype)
            out.append(_features(self.model.get_image_features(pixel_values=pixels)).float())
        return _unit(torch.cat(out)).cpu()

    @torch.inference_mode()
    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """Unit text embeddings [N, E], one per prompt; each distinct prompt is encoded once
        (a GRPO group shares its prompt). Prompts are padded to the full context, so a prompt's
        embedding does not depend on the others in its batch, and truncated to it."""
        unique = list(dict.fromkeys(prompts))
        texts = unique if self.clean_text is None else [self.clean_text(p) for p in unique]
        out = []
        for start in range(0, len(texts), self.batch_size):
            tokens = self.tokenizer(texts[start:start + self.batch_size], padding="max_length",
                                    truncation=True, max_length=self.max_length,
                                    return_tensors="pt").to(self.device)
            features = self.model.get_text_features(input_ids=tokens["input_ids"],
                                                    attention_mask=tokens["attention_mask"])
            out.append(_features(features).float())
        embeddings = _unit(torch.cat(out)).cpu()
        index = {prompt: i for i, prompt in enumerate(unique)}
        return embeddings[torch.tensor([index[p] for p in prompts], dtype=torch.long)]


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def load_clip_tokenizer(directory: os.PathLike, vocab_size: int, source: str, reward: str):
    """The tokenizer saved in `directory`, checked against the text model's vocabulary."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise RewardLoadError(f"reward {reward!r}: cannot load the tokenizer in {directory}: "
                              f"{first_line(err)}; restore its tokenizer files from the "
                              f"original download") from None
    check_vocabulary(tokenizer, vocab_size, source, reward)
    if tokenizer.pad_token is None:  # padded positions follow the end token, which is pooled
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_clip_model(directory: os.PathLike, source: str, reward: str,
                    dtype: torch.dtype) -> CLIPModel:
    """A CLIPModel saved in `directory` (config.json and weights)."""
    from transformers import CLIPConfig, CLIPModel

    try:
        config = CLIPConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as err:
        raise RewardLoadError(f"reward {reward!r}: {source} is not a CLIPModel directory "
                              f"(config.json: {first_line(err)})") from None
    if config.model_type != "clip":
        raise RewardLoadError(f"reward {reward!r}: {source} holds a {config.model_type!r} model, "
                              f"not a CLIPModel")
    try:
        return CLIPModel.from_pretrained(directory, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, RuntimeError) as err:
        raise RewardLoadError(f"reward {reward!r}: cannot load the CLIPModel weights in "
                              f"{directory}: {first_line(err)}; restore "
                              f"model.safetensors from the original download") from None


def load_clip_encoder(model: str | os.PathLike, processor: str | os.PathLike | None = None, *,
                      reward: str, device: str | torch.device = "cpu",
                      dtype: str | torch.dtype | None = None, batch_size: int = 16,
                      clean_text: Callable[[str], str] | None = None,
                      crop_rounding: str = "floor") -> ClipEncoder:
    """A ClipEncoder from a CLIPModel directory or cached hub id `model`; the tokenizer and
    preprocessor_config.json come from `processor` (default: `model` itself). `clean_text` and
    `crop_rounding` follow the reward authors' tokenizer and transform (see ClipScore)."""
    device, dtype = resolve_device_dtype(device, dtype)
    check_batch_size(batch_size)
    model_dir = resolve_model_dir(model, reward)
    processor_dir = model_dir if processor is None else resolve_model_dir(processor, reward)
    source = os.fspath(model)
    preprocess = replace(ImagePreprocess.load(processor_dir, reward), crop_rounding=crop_rounding)
    clip = load_clip_model(model_dir, source, reward, dtype)
    tokenizer = load_clip_tokenizer(processor_dir, clip.config.text_config.vocab_size,
                                    os.fspath(processor or model), reward)
    check_image_size(preprocess, clip.config.vision_config.image_size, source, reward)
    return ClipEncoder(clip, tokenizer, preprocess, device=device, dtype=dtype,
                       batch_size=batch_size, source=source, clean_text=clean_text)


def check_image_size(preprocess: ImagePreprocess, image_size: int, source: str,
                     reward: str) -> None:
    """The processor must produce the image size the vision tower's position table was built
    for (a processor of another model would fail at the first call, or worse, silently)."""
    size = preprocess.output_size
    if size is not None and size != (image_size, image_size):
        raise RewardLoadError(f"reward {reward!r}: the image processor crops to {size} but the "
                              f"vision model of {source} takes {image_size}x{image_size}; use "
                              f"the processor saved with the model")
