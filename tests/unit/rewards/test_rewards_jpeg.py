"""DDPO's JPEG rewards against PIL by hand, and their ordering."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from chunk_grpo.rewards import get_reward


def _jpeg_kb_by_hand(image: torch.Tensor) -> float:
    array = (image.permute(1, 2, 0).numpy() * 255).round().clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=95)
    return len(buffer.getvalue()) / 1000


def test_sizes_match_pil_by_hand():
    torch.manual_seed(0)
    images = torch.rand(3, 3, 64, 48)
    images[1] = 0.3  # flat
    images[2] = torch.linspace(0, 1, 48)  # smooth ramp
    expected = torch.tensor([_jpeg_kb_by_hand(im) for im in images])
    incompressibility = get_reward("jpeg_incompressibility")(images, ["a", "b", "c"])
    compressibility = get_reward("jpeg_compressibility")(images, ["a", "b", "c"])
    assert incompressibility.dtype == torch.float32 and incompressibility.shape == (3,)
    torch.testing.assert_close(incompressibility, expected, rtol=0, atol=0)
    torch.testing.assert_close(compressibility, -expected, rtol=0, atol=0)


def test_flat_image_compresses_better_than_noise():
    torch.manual_seed(1)
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand(1, 3, 64, 64)
    images = torch.cat([flat, noise])
    compressibility = get_reward("jpeg_compressibility")(images, ["x", "x"])
    assert compressibility[0] > compressibility[1]
    assert compressibility[1] < -5.0  # 64x64 RGB noise at quality 95 is well over 5 kB


def test_bad_inputs_are_clear_errors():
    reward = get_reward("jpeg_compressibility")
    with pytest.raises(ValueError, match="one each"):
        reward(torch.rand(2, 3, 8, 8), ["only one"])
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        reward(torch.rand(2, 8, 8), ["a", "b"])
    with pytest.raises(ValueError, match="quality"):
        get_reward("jpeg_compressibility", quality=100)


def test_nan_pixels_read_as_grey_and_out_of_range_clamped():
    """As the shapes reward does: a NaN pixel is grey, values outside [0, 1] are clipped."""
    reward = get_reward("jpeg_incompressibility")
    torch.manual_seed(2)
    clean = torch.rand(1, 3, 32, 32)
    broken = clean.clone()
    broken[0, :, :4, :4] = float("nan")
    fixed = clean.clone()
    fixed[0, :, :4, :4] = 0.5
    torch.testing.assert_close(reward(broken, ["x"]), reward(fixed, ["x"]), rtol=0, atol=0)
    torch.testing.assert_close(reward(clean * 3 - 1, ["x"]),
                               reward((clean * 3 - 1).clamp(0, 1), ["x"]), rtol=0, atol=0)
