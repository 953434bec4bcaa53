"""Run logging on rank 0: metrics, captioned image grids and the closing summary, sent to the
backends of `run.report_to` (a JSONL file, TensorBoard, Weights & Biases)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


class LogBackend:
    """One place a run's logs go (`run.report_to`). Every method does nothing by default."""

    def scalars(self, step: int, record: dict, numbers: dict[str, float]) -> None:
        """``record``: every logged value (tensors made Python numbers); ``numbers``: its
        finite numbers, the scalars a plotting backend shows."""

    def image(self, step: int, name: str, grid: Image.Image) -> None:
        """A captioned image grid (`captioned_grid`), e.g. "eval" at ``step``."""

    def summary(self, text: str, numbers: dict[str, float]) -> None:
        """The run's closing screen and its numbers (`chunk_grpo.train.summary`)."""

    def truncate_after(self, step: int) -> None:
        """Forget records of steps > ``step`` where the backend can (a resumed run)."""

    def close(self) -> None:
        pass


class JsonlBackend(LogBackend):
    """RUN/metrics.jsonl: one JSON object per logged step (`read_metrics`)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"

    def scalars(self, step: int, record: dict, numbers: dict[str, float]) -> None:
        fixed = {key: str(value) if isinstance(value, float) and not math.isfinite(value)
                 else value for key, value in record.items()}  # JSON has no NaN/Inf
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **fixed}) + "\n")

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in keep))


class TensorBoardBackend(LogBackend):
    """RUN/tensorboard/: the scalars, the image grids and the summary text."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def scalars(self, step: int, record: dict, numbers: dict[str, float]) -> None:
        for key, value in numbers.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def image(self, step: int, name: str, grid: Image.Image) -> None:
        self.writer.add_image(f"images/{name}", np.asarray(grid), step, dataformats="HWC")
        self.writer.flush()

    def summary(self, text: str, numbers: dict[str, float]) -> None:
        # Markdown: indented lines keep the screen's columns
        self.writer.add_text("summary", "\n".join("    " + line for line in text.splitlines()))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend(LogBackend):
    """A Weights & Biases run (`pip install 'chunk-grpo[wandb]'`), its files in RUN/wandb/.

    Every value is logged against the run's own "step" (wandb's define_metric), so a resumed
    run (the same wandb run, its id kept in RUN/wandb-run-id) may log a step again. With
    WANDB_MODE=offline nothing leaves the machine; `wandb sync RUN/wandb/offline-run-*` uploads
    it later."""

    ID_FILE = "wandb-run-id"

    def __init__(self, run_dir: Path, *, project: str, name: str, config: dict | None):
        import wandb

        self.wandb = wandb
        id_file = run_dir / self.ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None  # None: a new one
        self.run = wandb.init(project=project, name=name or run_dir.resolve().name, id=run_id,
                              resume="allow" if run_id else None, dir=str(run_dir),
                              config=config)
        id_file.write_text(self.run.id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def scalars(self, step: int, record: dict, numbers: dict[str, float]) -> None:
        self.run.log({**numbers, "step": step})

    def image(self, step: int, name: str, grid: Image.Image) -> None:
        self.run.log({f"images/{name}": self.wandb.Image(grid, caption=f"{name}, step {step}"),
                      "step": step})

    def summary(self, text: str, numbers: dict[str, float]) -> None:
        self.run.summary.update({**numbers, "summary": text})

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """A run's logs on rank 0, sent to each backend of ``report_to`` (`LogBackend`: jsonl,
    tensorboard, wandb); the image grids are also saved as PNGs in RUN/images/.

    On ranks other than 0 (``enabled`` False) every method does nothing.
    """

    def __init__(self, run_dir: str | Path, *, enabled: bool = True,
                 report_to: tuple[str, ...] | list[str] = ("tensorboard", "jsonl"),
                 name: str = "", project: str = "chunk-grpo", config: dict | None = None):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.backends: list[LogBackend] = []
        if not enabled:
            return
        for backend in dict.fromkeys(report_to):
            if backend == "jsonl":
                self.backends.append(JsonlBackend(self.run_dir))
            elif backend == "tensorboard":
                self.backends.append(TensorBoardBackend(self.run_dir))
            elif backend == "wandb":
                self.backends.append(WandbBackend(self.run_dir, project=project, name=name,
                                                  config=config))
            else:
                raise ValueError(f"unknown logging backend {backend!r}; use jsonl, tensorboard "
                                 "or wandb")

    def truncate_after(self, step: int) -> None:
        """Drop records of steps > ``step`` (written by a run that was stopped after its
        last checkpoint), so a resumed run's log matches an uninterrupted one."""
        for backend in self.backends:
            backend.truncate_after(step)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {key: value.item() if isinstance(value, torch.Tensor) else value
                  for key, value in metrics.items()}
        numbers = {key: value for key, value in record.items()
                   if isinstance(value, (int, float)) and math.isfinite(value)}
        for backend in self.backends:
            backend.scalars(step, record, numbers)

    def image_grid(self, step: int, name: str, images: torch.Tensor, captions: list[str], *,
                   columns: int = 8, filename: str | None = None) -> Path | None:
        """RUN/images/<name>-<step>.png (or ``filename``), captioned, with its captions in a
        .txt beside it; and the same grid to every backend."""
        if not self.enabled:
            return None
        grid = captioned_grid(images, captions, columns=columns)
        path = _save_grid(grid, captions,
                          self.run_dir / "images" / (filename or f"{name}-{step:06d}.png"))
        for backend in self.backends:
            backend.image(step, name, grid)
        return path

    def summary(self, text: str, numbers: dict[str, float]) -> None:
        if self.enabled:
            for backend in self.backends:
                backend.summary(text, numbers)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends = []


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
    return _save_grid(captioned_grid(images, captions, columns=columns), captions, path)


def _save_grid(grid: Image.Image, captions: list[str], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    path.with_suffix(".txt").write_text("\n".join(captions) + "\n")
    return path
