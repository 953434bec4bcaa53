"""Line plots as PNG with labelled, ticked axes and a legend, drawn with PIL (no plotting
dependency): the temporal-dynamics profile and the ablation's reward curves."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont

from chunk_grpo.algorithm.chunking import ChunkLayout

PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (1, 2 or 5 times a power of ten apart) covering
    [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"axis range must be finite, got [{low}, {high}]")
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step) * step
    ticks, value = [], first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 12))
    return ticks


def _label(value: float) -> str:
    return f"{value:.4g}"


def line_plot(series: dict[str, tuple[Sequence[float], Sequence[float]]], path: str | Path, *,
              title: str, xlabel: str, ylabel: str, vlines: Sequence[float] = (),
              vline_label: str = "", size: tuple[int, int] = (720, 420),
              spans: Sequence[tuple[float, float, str, tuple[int, int, int]]] = ()) -> Path:
    """Plot each ``name: (x, y)`` series as a line with markers; ``vlines`` are drawn as red
    vertical lines (e.g. chunk boundaries) and ``spans`` (x0, x1, label, RGB) as tinted bands
    behind the data, labelled at the top where the label fits (e.g. the chunks). Non-finite
    points are skipped."""
    if not series:
        raise ValueError("line_plot needs at least one series")
    font = ImageFont.load_default()
    width, height = size
    left, right, top, bottom = 70, 20, 36, 56
    legend = [(name, PALETTE[i % len(PALETTE)]) for i, name in enumerate(series)]
    if len(legend) == 1:
        legend = []  # one series: the title names it
    if vline_label:
        legend.append((vline_label, (214, 39, 40)))
    img = Image.new("RGB", (width, height + 14 * len(legend)), "white")
    draw = ImageDraw.Draw(img)
    points = [(x, y) for xs, ys in series.values() for x, y in zip(xs, ys, strict=True)
              if math.isfinite(x) and math.isfinite(y)]
    if not points:
        raise ValueError("line_plot: every point is NaN or infinite")
    xticks = nice_ticks(min(p[0] for p in points), max(p[0] for p in points))
    yticks = nice_ticks(min(p[1] for p in points), max(p[1] for p in points))

    def to_pixel(x: float, y: float) -> tuple[float, float]:
        fx = (x - xticks[0]) / (xticks[-1] - xticks[0])
        fy = (y - yticks[0]) / (yticks[-1] - yticks[0])
        return left + fx * (width - left - right), height - bottom - fy * (height - top - bottom)

    # bands, axes, grid and ticks
    x0, y0 = to_pixel(xticks[0], yticks[0])
    x1, y1 = to_pixel(xticks[-1], yticks[-1])
    for start, end, text, fill in spans:
        a = to_pixel(max(start, xticks[0]), yticks[0])[0]
        b = to_pixel(min(end, xticks[-1]), yticks[0])[0]
        if b <= a:
            continue
        draw.rectangle([(a, y1), (b, y0)], fill=fill)
        if 6 * len(text) + 4 <= b - a:
            draw.text(((a + b) / 2 - 3 * len(text), y1 + 3), text, fill=(90, 90, 90), font=font)
    for tick in xticks:
        px, _ = to_pixel(tick, yticks[0])
        draw.line([(px, y1), (px, y0)], fill=(235, 235, 235))
        draw.line([(px, y0), (px, y0 + 4)], fill="black")
        text = _label(tick)
        draw.text((px - 3 * len(text), y0 + 6), text, fill="black", font=font)
    for tick in yticks:
        _, py = to_pixel(xticks[0], tick)
        draw.line([(x0, py), (x1, py)], fill=(235, 235, 235))
        draw.line([(x0 - 4, py), (x0, py)], fill="black")
        text = _label(tick)
        draw.text((x0 - 8 - 6 * len(text), py - 6), text, fill="black", font=font)
    draw.line([(x0, y0), (x1, y0)], fill="black")
    draw.line([(x0, y0), (x0, y1)], fill="black")
    for x in vlines:
        px, _ = to_pixel(x, yticks[0])
        draw.line([(px, y1), (px, y0)], fill=(214, 39, 40), width=1)

    for index, (xs, ys) in enumerate(series.values()):
        colour = PALETTE[index % len(PALETTE)]
        pts = [to_pixel(x, y) for x, y in zip(xs, ys, strict=True)
               if math.isfinite(x) and math.isfinite(y)]
        if len(pts) > 1:
            draw.line(pts, fill=colour, width=2)
        if len(pts) <= 40:
            for px, py in pts:
                draw.ellipse([px - 3, py - 3, px + 3, py + 3], fill=colour)

    draw.text((left, 10), title, fill="black", font=font)
    draw.text(((x0 + x1) / 2 - 3 * len(xlabel), y0 + 24), xlabel, fill="black", font=font)
    label = Image.new("RGB", (6 * len(ylabel) + 8, 14), "white")
    ImageDraw.Draw(label).text((2, 1), ylabel, fill="black", font=font)
    rotated = label.rotate(90, expand=True)
    img.paste(rotated, (6, int((y0 + y1) / 2 - rotated.height / 2)))

    for i, (name, colour) in enumerate(legend):
        y = height + 14 * i
        draw.line([(left, y + 6), (left + 20, y + 6)], fill=colour, width=3)
        draw.text((left + 26, y), name, fill="black", font=font)
    img.save(path)
    return Path(path)


CHUNK_TINTS = ((226, 236, 250), (250, 236, 222))  # alternating chunk bands


UNTRAINED_TINT = (238, 238, 238)


def profile_marks(layout: ChunkLayout, num_steps: int
                  ) -> tuple[list[float], list[tuple[float, float, str, tuple[int, int, int]]]]:
    """(boundaries, bands) of a chunk layout on a profile of ``num_steps`` transitions: a
    boundary after every chunk (the last one ends the trained steps, when steps follow it), a
    band per chunk, and a grey band over the transitions that are not trained."""
    trained = layout.num_trained
    bounds = [start + size - 0.5 for start, size in zip(layout.starts, layout.sizes, strict=True)
              if start + size < num_steps]
    bands = [(start - 0.5, start + size - 0.5, f"chunk {j}", CHUNK_TINTS[j % 2])
             for j, (start, size) in enumerate(zip(layout.starts, layout.sizes, strict=True))]
    if trained < num_steps:
        bands.append((trained - 0.5, num_steps - 0.5, "not trained", UNTRAINED_TINT))
    return bounds, bands


def plot_profile(curve: torch.Tensor, layout: ChunkLayout, path: str | Path) -> Path:
    """The curve per step with the run's chunks as bands, their boundaries as red vertical
    lines, and the untrained steps in grey (PNG)."""
    steps = list(range(curve.numel()))
    bounds, bands = profile_marks(layout, curve.numel())
    last = layout.num_trained - 1
    return line_plot({"L1rel": (steps, curve.tolist())}, path,
                     title=f"temporal dynamics: L1rel(t) per sampling step; chunks "
                           f"{list(layout.sizes)} over steps 0-{last} of {curve.numel()}",
                     xlabel="sampling step t (0 = highest noise)",
                     ylabel="L1rel(t) = mean|x(t+1) - x(t)| / mean|x(t)|",
                     vlines=bounds, vline_label="chunk boundary", spans=bands)


def save_profile(curve: torch.Tensor, layout: ChunkLayout, out_dir: str | Path) -> None:
    """DIR/profile.json (the curve and the chunk sizes) and DIR/profile.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(
        {"l1rel": [round(v, 6) for v in curve.tolist()], "chunks": list(layout.sizes)},
        indent=2) + "\n")
    plot_profile(curve, layout, out / "profile.png")
