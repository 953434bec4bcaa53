"""CLIP image preprocessing on tensors: the published constants, PIL's resize, and transformers'
CLIPImageProcessor on 8-bit PIL images."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from reward_models_tiny import OPENAI_MEAN, OPENAI_PROCESSOR_CONFIG, OPENAI_STD, processor_config

from chunk_grpo.rewards import RewardLoadError
from chunk_grpo.rewards.image_preprocess import ImagePreprocess

try:  # transformers 5 without torchvision: the PIL backend under its own name
    from transformers import CLIPImageProcessorPil as ReferenceProcessor
except ImportError:
    from transformers import CLIPImageProcessor as ReferenceProcessor


def _images(seed: int, height: int, width: int, batch: int = 2) -> torch.Tensor:
    """Smooth-ish random 8-bit images as floats in [0, 1]."""
    torch.manual_seed(seed)
    x = torch.nn.functional.avg_pool2d(torch.rand(batch, 3, height, width), 3, 1, 1)
    return (x * 255).round() / 255


def _pil_float_reference(images: torch.Tensor, pre: ImagePreprocess) -> torch.Tensor:
    """PIL's bicubic resize of each float channel (mode "F", no 8-bit rounding), clamped as 8-bit
    images are, centre crop by index arithmetic, normalisation with the published constants."""
    height, width = images.shape[-2:]
    short = pre.shortest_edge
    if width <= height:
        size = (int(short * height / width), short)
    else:
        size = (short, int(short * width / height))
    out = torch.empty(images.shape[0], 3, *size)
    for i, image in enumerate(images):
        for c in range(3):
            channel = Image.fromarray(image[c].numpy().astype(np.float32), mode="F")
            out[i, c] = torch.from_numpy(np.array(channel.resize(size[::-1], Image.BICUBIC)))
    out = out.clamp(0, 1)
    crop_h, crop_w = pre.crop
    top, left = (size[0] - crop_h) // 2, (size[1] - crop_w) // 2
    out = out[..., top:top + crop_h, left:left + crop_w]
    mean, std = torch.tensor(pre.mean).view(1, 3, 1, 1), torch.tensor(pre.std).view(1, 3, 1, 1)
    return (out - mean) / std


def test_openai_config_gives_the_published_constants():
    pre = ImagePreprocess.from_config(OPENAI_PROCESSOR_CONFIG)
    assert pre.shortest_edge == 224 and pre.crop == (224, 224) and pre.mode == "bicubic"
    assert pre.mean == (0.48145466, 0.4578275, 0.40821073)
    assert pre.std == (0.26862954, 0.26130258, 0.27577711)
    grey = torch.full((1, 3, 64, 96), 0.5)
    out = pre(grey)
    assert out.shape == (1, 3, 224, 224)
    expected = (0.5 - torch.tensor(OPENAI_MEAN)) / torch.tensor(OPENAI_STD)
    torch.testing.assert_close(out[0, :, 100, 100], expected, rtol=0, atol=1e-6)
    # Today's layout (dict sizes) reads the same.
    assert ImagePreprocess.from_config(processor_config(224)) == pre


@pytest.mark.parametrize("height,width", [(64, 96), (300, 260), (64, 64)])
def test_resize_matches_pil_bicubic_on_floats(height, width):
    pre = ImagePreprocess.from_config(OPENAI_PROCESSOR_CONFIG)
    images = _images(0, height, width)
    # Measured: at most 2.4e-5 (normalised units) for these sizes.
    torch.testing.assert_close(pre(images), _pil_float_reference(images, pre), rtol=0, atol=1e-4)


@pytest.mark.parametrize("config,height,width", [
    (OPENAI_PROCESSOR_CONFIG, 64, 96),
    (processor_config(32, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3)), 64, 64),
    (processor_config(64), 64, 64),
])
def test_matches_transformers_clip_image_processor(config, height, width):
    """Against CLIPImageProcessor on 8-bit PIL images: it rounds the resized image to 8 bits,
    which costs up to ~1.1 grey levels; measured max difference 0.016 (normalised units)."""
    pre = ImagePreprocess.from_config(config)
    images = _images(1, height, width)
    processor = ReferenceProcessor(**{k: v for k, v in config.items() if not k.endswith("_type")})
    pil = [Image.fromarray((im.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
           for im in images]
    reference = processor(images=pil, return_tensors="pt")["pixel_values"]
    assert pre(images).shape == reference.shape
    torch.testing.assert_close(pre(images), reference, rtol=0, atol=0.02)


def test_small_checkpoint_is_preprocessed_its_own_way():
    pre = ImagePreprocess.from_config(processor_config(64, mean=(0.5,) * 3, std=(0.25,) * 3))
    images = _images(2, 64, 64)
    # Same size: no resize, no crop; just its own mean/std.
    torch.testing.assert_close(pre(images), (images - 0.5) / 0.25, rtol=0, atol=1e-6)


def test_missing_or_bad_config_is_a_load_error(tmp_path):
    with pytest.raises(RewardLoadError, match="preprocessor_config.json"):
        ImagePreprocess.load(tmp_path, "clip")
    config = dict(OPENAI_PROCESSOR_CONFIG, resample=1)  # Lanczos: torch has none
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(RewardLoadError, match="resample"):
        ImagePreprocess.load(tmp_path, "clip")
