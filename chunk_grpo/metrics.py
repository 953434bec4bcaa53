"""Run logging on rank 0: a JSONL file of metrics, TensorBoard scalars, image grids."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont


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


def captioned_grid(
    images: torch.Tensor, captions: list[str], *, columns: int = 8, cell: int = 128
) -> Image.Image:
    """One PIL image: each image scaled to `cell` pixels with its caption underneath (pixel art is
    enlarged with nearest-neighbour so it stays sharp; large images are reduced with Lanczos)."""
    if len(captions) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(captions)} captions")
    font = ImageFont.load_default()
    chars_per_line = max(8, cell // 6)
    wrapped = [textwrap.wrap(c, chars_per_line) or [""] for c in captions]
    line_height = 11
    text_height = line_height * max(len(lines) for lines in wrapped) + 4
    rows = math.ceil(len(captions) / columns)
    cols = min(columns, len(captions))
    sheet = Image.new("RGB", (cols * cell, rows * (cell + text_height)), "white")
    draw = ImageDraw.Draw(sheet)
    pixels = images.detach().float().cpu().clamp(0, 1).mul(255).round().to(torch.uint8)
    resample = Image.NEAREST if images.shape[-1] <= cell else Image.LANCZOS
    for i, (image, lines) in enumerate(zip(pixels.permute(0, 2, 3, 1).numpy(), wrapped,
                                           strict=True)):
        x, y = (i % columns) * cell, (i // columns) * (cell + text_height)
        sheet.paste(Image.fromarray(image).resize((cell, cell), resample), (x, y))
        for j, line in enumerate(lines):
            draw.text((x + 2, y + cell + 2 + j * line_height), line, fill="black", font=font)
    return sheet


def reward_captions(prompts: list[str], rewards: torch.Tensor | list[float]) -> list[str]:
    """"0.42  three red circles": the caption of a scored image."""
    values = rewards.tolist() if isinstance(rewards, torch.Tensor) else list(rewards)
    return [f"{r:.2f}  {p}" for p, r in zip(prompts, values, strict=True)]


def save_image_grid(images: torch.Tensor, path: str | Path, captions: list[str], *,
                    columns: int = 8) -> Path:
    """Save a captioned grid PNG, and the captions next to it as a .txt file (one per image)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    captioned_grid(images, captions, columns=columns).save(path)
    path.with_suffix(".txt").write_text("\n".join(captions) + "\n")
    return path
