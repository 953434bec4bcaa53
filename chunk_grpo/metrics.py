"""Run logging on rank 0: a JSONL file of metrics, TensorBoard scalars, image grids."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image


class MetricsLogger:
    """Writes `metrics.jsonl` (one object per logged step) and TensorBoard events in run_dir.

    On ranks other than 0 every method does nothing.
    """

    def __init__(self, run_dir: str | Path, *, enabled: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.writer = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Drop records of steps > ``step`` (written by a run that was stopped after its
        last checkpoint), so a resumed run's log matches an uninterrupted one."""
        if not self.enabled or not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step}
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                value = value.item()
            if isinstance(value, float) and not math.isfinite(value):
                value = str(value)  # JSON has no NaN/Inf
            record[key] = value
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def image_grid(images: torch.Tensor, ncols: int) -> Image.Image:
    """[B, 3, H, W] in [0, 1] -> one PIL image, ``ncols`` per row."""
    b, _, h, w = images.shape
    nrows = math.ceil(b / ncols)
    grid = np.full((nrows * h, ncols * w, 3), 255, dtype=np.uint8)
    pixels = (images.detach().float().clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1)
    for i, img in enumerate(pixels.cpu().numpy()):
        r, c = divmod(i, ncols)
        grid[r * h:(r + 1) * h, c * w:(c + 1) * w] = img
    return Image.fromarray(grid)


def save_image_grid(images: torch.Tensor, path: str | Path, ncols: int,
                    captions: list[str] | None = None) -> Path:
    """Save a grid PNG, and the row captions next to it as a .txt file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, ncols).save(path)
    if captions:
        path.with_suffix(".txt").write_text("\n".join(captions) + "\n")
    return path
