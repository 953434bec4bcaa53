"""Image preprocessing of the reward models, done on tensors as their authors' code does it on
8-bit PIL images; CLIP image processors are read from their preprocessor_config.json.

Every checkpoint is preprocessed its own way: the resize (shortest edge, or a fixed size), the
interpolation, the centre crop and the mean/std all come from the saved config, so a 64x64 CLIP
trained on the shapes world and a 224x224 CLIP-H are each fed what they were trained on.

The authors' scorers take PIL images, which their training loops make by rounding the decoded
image to 8 bits, so the input is first rounded to 8 bits here too (`round(255 x)`). Then either
- `resize="pil"` (transformers' CLIPImageProcessor and torchvision's transforms on PIL images:
  PickScore, CLIP, aesthetic, ImageReward): PIL's own bicubic resize, done exactly (its fixed-point
  coefficients, a horizontal then a vertical pass, each rounded and clipped to 8 bits), so the
  pixels equal PIL's bit for bit; or
- `resize="float"` (open_clip's transforms, which resize after ToTensor: HPSv2): torch's
  antialiased resize of the float image, which is torchvision's resize of a float tensor.
Then the centre crop (transformers' top-left (h - c) // 2, or torchvision's round((h - c) / 2))
or, with `longest_edge`, open_clip's ResizeMaxSize (the longest side to the size, round(side *
scale), zero padding around: black), and the normalisation.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
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
    """Round to 8 bits, resize, centre-crop (or pad) and normalise float images [B, 3, H, W]."""

    shortest_edge: int | None  # resize keeping the aspect ratio; None with resize_to or no resize
    resize_to: tuple[int, int] | None  # (height, width) of a resize to a fixed size
    crop: tuple[int, int] | None  # (height, width) of the centre crop; None = no crop
    mode: str  # torch interpolation mode
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resize: str = "pil"  # "pil": PIL's 8-bit resize, exactly; "float": torch's antialiased one
    crop_rounding: str = "floor"  # crop offset (h - c) // 2 (transformers) or "round" (torchvision)
    longest_edge: int | None = None  # open_clip's ResizeMaxSize: longest side to this, pad square

    def __post_init__(self):
        if self.resize not in ("pil", "float"):
            raise ValueError(f"resize must be 'pil' or 'float', got {self.resize!r}")
        if self.crop_rounding not in ("floor", "round"):
            raise ValueError(f"crop_rounding must be 'floor' or 'round', got "
                             f"{self.crop_rounding!r}")

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
        if self.longest_edge is not None:
            return self.longest_edge, self.longest_edge
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
        images = (images.float().clamp(0.0, 1.0) * 255).round()  # the 8-bit image, 0..255
        height, width = images.shape[-2:]
        if self.longest_edge is not None:
            images = self._resize_max_size(images)
        else:
            size = self._resized_size(height, width)
            if size != (height, width):
                images = self._resize(images, size)
        images = images / 255
        if self.crop is not None:
            images = _center_crop(images, *self.crop, self.crop_rounding)
        mean = images.new_tensor(self.mean).view(1, 3, 1, 1)
        std = images.new_tensor(self.std).view(1, 3, 1, 1)
        return (images - mean) / std

    def _resize(self, images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """Resize 8-bit valued images (0..255 floats) to `size`."""
        if self.resize == "pil" and self.mode in _PIL_FILTERS:
            return pil_resize_8bit(images, size, self.mode)
        smooth = self.mode in ("bilinear", "bicubic")
        return F.interpolate(images, size=size, mode=self.mode, antialias=smooth,
                             align_corners=False if smooth else None)

    def _resize_max_size(self, images: torch.Tensor) -> torch.Tensor:
        """open_clip's ResizeMaxSize: the longest side to `longest_edge` (the other
        round(side * scale)), then black padding, left/top getting the smaller half."""
        height, width = images.shape[-2:]
        target = self.longest_edge
        scale = target / float(max(height, width))
        if scale == 1.0:
            return images
        size = (round(height * scale), round(width * scale))
        images = self._resize(images, size)
        pad_h, pad_w = target - size[0], target - size[1]
        return F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))


# PIL's resampling filters (Resample.c): support and kernel. Bicubic uses a = -0.5.
def _bicubic(x: torch.Tensor) -> torch.Tensor:
    a = -0.5
    x = x.abs()
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1.0, near, torch.where(x < 2.0, far, torch.zeros_like(x)))


# Only bicubic (every reward's) is done PIL's way; other modes use torch's resize.
_PIL_FILTERS = {"bicubic": (2.0, _bicubic)}
_PRECISION_BITS = 32 - 8 - 2  # PIL's fixed point for 8-bit images


@lru_cache(maxsize=32)
def _pil_weights(in_size: int, out_size: int, mode: str) -> torch.Tensor:
    """PIL's integer resampling weights as a float64 matrix [in_size, out_size]
    (precompute_coeffs, then normalize_coeffs_8bpc: round half away from zero at 2^22)."""
    support, kernel = _PIL_FILTERS[mode]
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = support * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    weights = torch.zeros(in_size, out_size, dtype=torch.float64)
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size)
        taps = torch.arange(xmin, xmax, dtype=torch.float64)[:ksize]
        k = kernel((taps - center + 0.5) / filterscale)
        total = float(k.sum())
        if total != 0.0:
            k = k / total
        fixed = torch.sign(k) * torch.floor(k.abs() * (1 << _PRECISION_BITS) + 0.5)
        weights[xmin:xmin + len(taps), xx] = fixed
    return weights


def _pil_pass(images: torch.Tensor, out_size: int, mode: str) -> torch.Tensor:
    """One PIL pass along the last dim: fixed-point sums, rounded, clipped to 0..255."""
    weights = _pil_weights(images.shape[-1], out_size, mode).to(images.device)
    acc = images.double() @ weights + (1 << (_PRECISION_BITS - 1))  # exact in float64
    return torch.floor(acc / (1 << _PRECISION_BITS)).clamp(0, 255).to(images.dtype)


def pil_resize_8bit(images: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """PIL's Image.resize of 8-bit images (given as 0..255 floats [B, C, H, W]) to
    (height, width) with BICUBIC, bit-exact: horizontal pass, then vertical."""
    height, width = size
    if width != images.shape[-1]:
        images = _pil_pass(images, width, mode)
    if height != images.shape[-2]:
        images = _pil_pass(images.transpose(-1, -2), height, mode).transpose(-1, -2)
    return images


def _center_crop(images: torch.Tensor, crop_h: int, crop_w: int,
                 rounding: str = "floor") -> torch.Tensor:
    """The centre (crop_h, crop_w) window, zero-padded first when the image is smaller (as
    transformers' center_crop does). The offset of an odd margin: transformers takes
    (h - c) // 2, torchvision int(round((h - c) / 2)) (to even)."""
    height, width = images.shape[-2:]
    if height < crop_h or width < crop_w:
        pad_h, pad_w = max(crop_h - height, 0), max(crop_w - width, 0)
        images = F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
        height, width = images.shape[-2:]
    if rounding == "round":
        top, left = int(round((height - crop_h) / 2.0)), int(round((width - crop_w) / 2.0))
    else:
        top, left = (height - crop_h) // 2, (width - crop_w) // 2
    return images[..., top:top + crop_h, left:left + crop_w]
