"""DDPO's `jpeg_compressibility` and `jpeg_incompressibility` rewards (Black et al. 2023).

Each image is rounded to 8 bits, saved by PIL as a JPEG of quality 95, and its size measured in
kB (1000 bytes, as DDPO divides by 1000):

    jpeg_incompressibility = +size_kB        jpeg_compressibility = -size_kB

Prompts are ignored. Flat, smooth images compress well; noise and fine texture do not.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from chunk_grpo.rewards.model_files import reward_inputs
from chunk_grpo.rewards.registry import register_reward

DDPO_QUALITY = 95


def jpeg_sizes_kb(images: torch.Tensor, quality: int = DDPO_QUALITY) -> torch.Tensor:
    """float32 [B]: size in kB of each image [B, 3, H, W] in [0, 1] saved as a JPEG."""
    pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).cpu()
    arrays = pixels.permute(0, 2, 3, 1).numpy()
    sizes = []
    for array in arrays:
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(array)).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


def _check_quality(quality: int) -> int:
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 95:
        raise ValueError(f"quality must be an int in [1, 95] (PIL's JPEG range), got {quality!r}")
    return quality


@register_reward("jpeg_incompressibility")
class JpegIncompressibility:
    """+JPEG size in kB: rewards detail (and noise)."""

    sign = 1.0

    def __init__(self, quality: int = DDPO_QUALITY):
        self.quality = _check_quality(quality)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        images, _ = reward_inputs(images, prompts)
        return self.sign * jpeg_sizes_kb(images, self.quality)


@register_reward("jpeg_compressibility")
class JpegCompressibility(JpegIncompressibility):
    """-JPEG size in kB: rewards flat, simple images."""

    sign = -1.0
