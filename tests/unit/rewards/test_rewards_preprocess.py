"""Reward image preprocessing on tensors: the published constants, PIL's 8-bit resize (exactly),
transformers' CLIPImageProcessor on 8-bit PIL images, open_clip's ResizeMaxSize padding."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from reward_models_tiny import OPENAI_MEAN, OPENAI_PROCESSOR_CONFIG, OPENAI_STD, processor_config

from chunk_grpo.rewards import RewardLoadError
from chunk_grpo.rewards.image_preprocess import ImagePreprocess, pil_resize_8bit

try:  # transformers 5 without torchvision: the PIL backend under its own name
    from transformers import CLIPImageProcessorPil as ReferenceProcessor
except ImportError:
    from transformers import CLIPImageProcessor as ReferenceProcessor


def _images(seed: int, height: int, width: int, batch: int = 2) -> torch.Tensor:
    """Smooth-ish random 8-bit images as floats in [0, 1]."""
    torch.manual_seed(seed)
    x = torch.nn.functional.avg_pool2d(torch.rand(batch, 3, height, width), 3, 1, 1)
    return (x * 255).round() / 255


def _pil_float_reference(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """PIL's bicubic resize of each float channel (mode "F", no 8-bit rounding)."""
    out = torch.empty(images.shape[0], 3, *size)
    for i, image in enumerate(images):
        for c in range(3):
            channel = Image.fromarray(image[c].numpy().astype(np.float32), mode="F")
            out[i, c] = torch.from_numpy(np.array(channel.resize(size[::-1], Image.BICUBIC)))
    return out


def _pil_8bit(images: torch.Tensor) -> list[Image.Image]:
    return [Image.fromarray((im.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
            for im in images]


def test_openai_config_gives_the_published_constants():
    pre = ImagePreprocess.from_config(OPENAI_PROCESSOR_CONFIG)
    assert pre.shortest_edge == 224 and pre.crop == (224, 224) and pre.mode == "bicubic"
    assert pre.mean == (0.48145466, 0.4578275, 0.40821073)
    assert pre.std == (0.26862954, 0.26130258, 0.27577711)
    grey = torch.full((1, 3, 64, 96), 0.5)
    out = pre(grey)
    assert out.shape == (1, 3, 224, 224)
    # 0.5 is rounded to 8 bits first (round half to even: 127.5 -> 128), as PIL images are.
    expected = (128 / 255 - torch.tensor(OPENAI_MEAN)) / torch.tensor(OPENAI_STD)
    torch.testing.assert_close(out[0, :, 100, 100], expected, rtol=0, atol=1e-6)
    # Today's layout (dict sizes) reads the same.
    assert ImagePreprocess.from_config(processor_config(224)) == pre


@pytest.mark.parametrize("height,width,size", [(64, 96, (224, 336)), (300, 260, (258, 224)),
                                               (1024, 768, (298, 224)), (64, 64, (31, 17))])
def test_8bit_resize_is_pils_bit_for_bit(height, width, size):
    images = _images(0, height, width, batch=1)
    got = pil_resize_8bit(images * 255, size, "bicubic")
    want = np.array(_pil_8bit(images)[0].resize(size[::-1], Image.BICUBIC))
    assert torch.equal(got[0].permute(1, 2, 0), torch.from_numpy(want).float())


@pytest.mark.parametrize("height,width", [(64, 96), (300, 260)])
def test_float_resize_matches_pil_bicubic_on_floats(height, width):
    """resize="float" (open_clip's resize after ToTensor) is the antialiased bicubic PIL uses,
    kept in floats: no 8-bit rounding, no clamp."""
    images = _images(0, height, width)
    pre = ImagePreprocess(shortest_edge=224, resize_to=None, crop=None, mode="bicubic",
                          mean=(0.0,) * 3, std=(1.0,) * 3, resize="float")
    size = pre(images).shape[-2:]
    # Measured: at most 2.4e-5 for these sizes.
    torch.testing.assert_close(pre(images), _pil_float_reference(images, tuple(size)), rtol=0,
                               atol=1e-4)


def test_resize_max_size_pads_with_black():
    """open_clip's ResizeMaxSize: the longest side to the size, round(other * scale), zero
    padding split with the smaller half on the left/top; a square of the size is untouched."""
    pre = ImagePreprocess(shortest_edge=None, resize_to=None, crop=None, mode="bicubic",
                          mean=(0.0,) * 3, std=(1.0,) * 3, resize="float", longest_edge=32)
    assert pre.output_size == (32, 32)
    white = torch.ones(1, 3, 40, 27)  # -> 32 x round(21.6) = 22: pad 10 = 5 left + 5 right
    out = pre(white)
    assert out.shape == (1, 3, 32, 32)
    assert out[..., :5].abs().max() == 0 and out[..., 27:].abs().max() == 0
    torch.testing.assert_close(out[..., 5:27], torch.ones(1, 3, 32, 22))
    wide = torch.ones(1, 3, 17, 64)  # -> round(8.5) = 8 x 32: pad 24 = 12 top + 12 bottom
    assert pre(wide)[..., 12:20, :].min() > 0.99 and pre(wide)[..., :12, :].abs().max() == 0
    square = _images(3, 32, 32, batch=1)
    torch.testing.assert_close(pre(square), square, rtol=0, atol=1e-7)


def test_crop_offsets_of_transformers_and_torchvision():
    """An odd margin: transformers' offset (h - c) // 2, torchvision's round((h - c) / 2)."""
    ramp = torch.arange(7.0).view(1, 1, 7, 1).expand(1, 3, 7, 4) / 255
    base = dict(shortest_edge=None, resize_to=None, crop=(4, 4), mode="bicubic",
                mean=(0.0,) * 3, std=(1.0,) * 3)
    floor = ImagePreprocess(**base)(ramp)  # margin 3: offset 1
    rounded = ImagePreprocess(**base, crop_rounding="round")(ramp)  # round(1.5) = 2
    assert floor[0, 0, 0, 0] * 255 == pytest.approx(1) and rounded[0, 0, 0, 0] * 255 == \
        pytest.approx(2)


@pytest.mark.parametrize("config,height,width", [
    (OPENAI_PROCESSOR_CONFIG, 64, 96),
    (processor_config(32, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3)), 64, 64),
    (processor_config(64), 64, 64),
])
def test_matches_transformers_clip_image_processor(config, height, width):
    """Against CLIPImageProcessor on 8-bit PIL images: the same pixels (PIL's 8-bit resize is
    reproduced exactly), up to float32 rounding of the normalisation."""
    pre = ImagePreprocess.from_config(config)
    images = _images(1, height, width)
    processor = ReferenceProcessor(**{k: v for k, v in config.items() if not k.endswith("_type")})
    reference = processor(images=_pil_8bit(images), return_tensors="pt")["pixel_values"]
    assert pre(images).shape == reference.shape
    torch.testing.assert_close(pre(images), reference, rtol=0, atol=1e-6)


def test_small_checkpoint_is_preprocessed_its_own_way():
    pre = ImagePreprocess.from_config(processor_config(64, mean=(0.5,) * 3, std=(0.25,) * 3))
    images = _images(2, 64, 64)  # 8-bit values already
    # Same size: no resize, no crop; just its own mean/std.
    torch.testing.assert_close(pre(images), (images - 0.5) / 0.25, rtol=0, atol=1e-6)


def test_missing_or_bad_config_is_a_load_error(tmp_path):
    with pytest.raises(RewardLoadError, match="preprocessor_config.json"):
        ImagePreprocess.load(tmp_path, "clip")
    config = dict(OPENAI_PROCESSOR_CONFIG, resample=1)  # Lanczos: torch has none
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(RewardLoadError, match="resample"):
        ImagePreprocess.load(tmp_path, "clip")
