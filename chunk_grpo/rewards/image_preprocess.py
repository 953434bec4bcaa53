"""A CLIP image processor's preprocessing, done on tensors, read from its preprocessor_config.json.

Every checkpoint is preprocessed its own way: the resize (shortest edge, or a fixed size), the
interpolation, the centre crop and the mean/std all come from the saved config, so a 64x64 CLIP
trained on the shapes world and a 224x224 CLIP-H are each fed what they were trained on.

The steps follow transformers' CLIPImageProcessor on PIL images (and open_clip's, which is the
same for these configs): resize so the shortest side is `shortest_edge` (the long side
int(size * long / short)), crop the centre, normalise. Differences, all small: PIL resizes 8-bit
images and rounds the result; here float images are resized with torch's antialiased kernels
(`antialias=True`, which use PIL's bicubic a = -0.5, not torch's plain a = -0.75) and clamped to
[0, 1] as 8-bit images are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from chunk_grpo.rewards.registry import RewardLoadError

CONFIG_NAME = "preprocessor_config.json"
# PIL's resampling codes, as transformers saves them; torch has no Lanczos, box or Hamming filter.
_MODES = {0: "nearest-exact", 2: "bilinear", 3: "bicubic",
          "nearest": "nearest-exact", "bilinear": "bilinear", "bicubic": "bicubic"}


def _height_width(value, key: str) -> tuple[int, int] | None:
    if isinstance(value, int):
        return value, value
    if isinstance(value, dict) and "height" in value and "width" in value:
        return int(value["height"]), int(value["width"])
    raise ValueError(f"{key} {value!r} is neither an int nor {{'height', 'width'}}")


@dataclass(frozen=True)
class ImagePreprocess:
    """Resize, centre-crop and normalise float images [B, 3, H, W] in [0, 1]."""

    shortest_edge: int | None  # resize keeping the aspect ratio; None with resize_to or no resize
    resize_to: tuple[int, int] | None  # (height, width) of a resize to a fixed size
    crop: tuple[int, int] | None  # (height, width) of the centre crop; None = no crop
    mode: str  # torch interpolation mode
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def from_config(cls, config: dict) -> ImagePreprocess:
        """From the dict of a saved CLIP image processor (old and new layouts of `size`)."""
        shortest_edge = resize_to = crop = None
        if config.get("do_resize", True):
            size = config["size"]
            if isinstance(size, int):  # old configs: an int is the shortest edge for CLIP
                shortest_edge = size
            elif isinstance(size, dict) and "shortest_edge" in size:
                shortest_edge = int(size["shortest_edge"])
            else:
                resize_to = _height_width(size, "size")
        if config.get("do_center_crop", True):
            crop = _height_width(config["crop_size"], "crop_size")
        resample = config.get("resample", 3)
        if resample not in _MODES:
            raise ValueError(f"resample {resample!r} is not supported (nearest, bilinear or "
                             f"bicubic: 0, 2 or 3)")
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        if config.get("do_normalize", True):
            mean = tuple(float(v) for v in config["image_mean"])
            std = tuple(float(v) for v in config["image_std"])
            if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
                raise ValueError(f"image_mean {mean} / image_std {std} must be 3 values, std > 0")
        return cls(shortest_edge, resize_to, crop, _MODES[resample], mean, std)

    @classmethod
    def load(cls, directory: Path, reward: str) -> ImagePreprocess:
        """From `directory/preprocessor_config.json`; a missing or bad file is a RewardLoadError."""
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            raise RewardLoadError(f"reward {reward!r}: {directory} has no {CONFIG_NAME} (the "
                                  f"image processor's config); copy it from the model's download "
                                  f"or pass the processor's directory")
        try:
            return cls.from_config(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as err:
            raise RewardLoadError(f"reward {reward!r}: {path} is not a usable CLIP image "
                                  f"processor config: {err}") from None

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every output, when it does not depend on the input size."""
        return self.crop or self.resize_to

    def _resized_size(self, height: int, width: int) -> tuple[int, int]:
        if self.resize_to is not None:
            return self.resize_to
        if self.shortest_edge is None:
            return height, width
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """float32 [B, 3, h, w], normalised, on the images' device."""
        images = images.float()
        height, width = images.shape[-2:]
        size = self._resized_size(height, width)
        if size != (height, width):
            smooth = self.mode in ("bilinear", "bicubic")
            images = F.interpolate(images, size=size, mode=self.mode, antialias=smooth,
                                   align_corners=False if smooth else None)
            images = images.clamp(0.0, 1.0)
        if self.crop is not None:
            images = _center_crop(images, *self.crop)
        mean = images.new_tensor(self.mean).view(1, 3, 1, 1)
        std = images.new_tensor(self.std).view(1, 3, 1, 1)
        return (images - mean) / std


def _center_crop(images: torch.Tensor, crop_h: int, crop_w: int) -> torch.Tensor:
    """The centre (crop_h, crop_w) window, zero-padded first when the image is smaller (as
    transformers' center_crop does)."""
    height, width = images.shape[-2:]
    if height < crop_h or width < crop_w:
        pad_h, pad_w = max(crop_h - height, 0), max(crop_w - width, 0)
        images = F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
        height, width = images.shape[-2:]
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    return images[..., top:top + crop_h, left:left + crop_w]
