"""Image grids carry their captions in the picture, and beside it as text."""

import numpy as np
import torch
from PIL import Image

from chunk_grpo.train.metrics import reward_captions, save_image_grid


def test_grid_draws_each_caption_under_its_image(tmp_path):
    images = torch.ones(3, 3, 16, 16)  # white images: any dark pixel is caption text
    captions = reward_captions(["a red circle", "two blue squares", "x"], torch.tensor([.5, 1, 0]))
    assert captions[0] == "0.50  a red circle"
    path = save_image_grid(images, tmp_path / "g.png", captions, columns=2)
    sheet = np.asarray(Image.open(path).convert("L"))
    cell = 128
    assert sheet.shape[1] == 2 * cell and sheet.shape[0] > 2 * cell  # 2 rows, text under each
    row_height = sheet.shape[0] // 2
    for index in range(3):
        r, c = divmod(index, 2)
        text_band = sheet[r * row_height + cell:(r + 1) * row_height, c * cell:(c + 1) * cell]
        assert (text_band < 128).any(), f"no caption drawn under image {index}"
        assert (sheet[r * row_height:r * row_height + cell, c * cell:(c + 1) * cell] == 255).all()
    assert path.with_suffix(".txt").read_text().splitlines() == captions
