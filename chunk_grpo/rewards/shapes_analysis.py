"""Find the objects in a shapes-world image with classical image analysis.

Pixels are foreground when saturated (chroma = max - min channel); a foreground pixel's colour
is the palette colour of nearest hue. Mixing a colour with the grey background keeps its hue, so
soft or blurry edges of generated images still read as the right colour. Objects are the
4-connected foreground components of plausible size, purity and solidity (share of interior
pixels, which separates filled shapes from ragged noise clusters); for each one we measure its
colour histogram, fill ratio of its bounding box (square 1.0, disc 0.8, triangle 0.55), extent,
centroid, and how low the centroid sits in the box (0.5 for discs and squares, 0.64 for upward
triangles: this survives blur better than the fill ratio).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from scipy import ndimage

from chunk_grpo.shapes.grammar import COLOURS
from chunk_grpo.shapes.render import PALETTE

CHROMA_MIN = 60.0  # of 255; the palette's chroma is 140 to 210, half-blended edges ~70+
MIN_AREA_AT_64 = 20  # smallest object (small triangle) has ~60 pixels
MAX_EXTENT_AT_64 = 28  # large objects are 16 px; bigger blobs are not objects
MIN_FILL = 0.3  # below this a component is a scribble, not a shape
MIN_PURITY = 0.4  # share of the majority colour; random-noise clusters have about 1/6
# Share of a component's pixels whose 4 neighbours are in it too. Solid shapes at 64x64 have
# 0.53 (small triangle) to 0.8; ragged noise clusters mostly under 0.3. Small shapes on smaller
# canvases have relatively more edge, so the band scales with the canvas below 64.
INTERIOR_BAND_AT_64 = (0.25, 0.45)  # objectness 0 below, 1 above, linear in between


def _hue_degrees(rgb: np.ndarray) -> np.ndarray:
    """Hue in [0, 360) of float RGB [..., 3]; undefined (0) where chroma is 0."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    mx = rgb.max(axis=-1)
    chroma = mx - rgb.min(axis=-1)
    safe = np.where(chroma > 0, chroma, 1.0)
    hue = np.where(
        mx == r,
        ((g - b) / safe) % 6.0,
        np.where(mx == g, (b - r) / safe + 2.0, (r - g) / safe + 4.0),
    )
    return hue * 60.0


PALETTE_HUES = _hue_degrees(np.array([PALETTE[c] for c in COLOURS], dtype=np.float32))


LUT_BITS = 6  # per channel: 64 levels are 4 grey levels apart, far finer than the thresholds


def _class_of_rgb(rgb: np.ndarray) -> np.ndarray:
    """int8 palette index (into COLOURS) per float RGB [..., 3] on 0..255, -1 for background."""
    chroma = rgb.max(axis=-1) - rgb.min(axis=-1)
    diff = np.abs(_hue_degrees(rgb)[..., None] - PALETTE_HUES)
    classes = np.minimum(diff, 360.0 - diff).argmin(axis=-1).astype(np.int8)
    classes[chroma < CHROMA_MIN] = -1
    return classes


def _build_lut() -> torch.Tensor:
    levels = (np.arange(2**LUT_BITS, dtype=np.float32) + 0.5) * 256.0 / 2**LUT_BITS
    grid = np.stack(np.meshgrid(levels, levels, levels, indexing="ij"), axis=-1)
    return torch.from_numpy(_class_of_rgb(grid).ravel())


_LUT = _build_lut()  # class of every quantised (r, g, b): one table look-up per pixel


def classify_pixels(images: torch.Tensor) -> np.ndarray:
    """int8 [B, H, W] palette index per pixel (index into COLOURS), -1 for background.

    images: float [B, 3, H, W] in [0, 1].
    """
    levels = 2**LUT_BITS
    out = []
    for chunk in images.split(32):  # small chunks stay in cache: ~2x faster than one pass
        q = (chunk * levels).clamp_(0, levels - 1).to(torch.int32)
        index = (q[:, 0] * levels + q[:, 1]) * levels + q[:, 2]
        out.append(_LUT[index])
    return torch.cat(out).numpy()


@dataclass(frozen=True)
class Detection:
    colour_fractions: np.ndarray  # [len(COLOURS)] share of the pixels of each colour
    area: int
    extent: float  # max(width, height) of the bounding box, in 64x64 pixels
    fill: float  # area / bounding-box area
    aspect: float  # min(width, height) / max(width, height)
    objectness: float  # in [0, 1], from the interior share: how solid the component is
    depth: float  # centroid row within the box, 0 = top, 1 = bottom (0.64 for a triangle)
    cx: float  # centroid column, pixels
    cy: float  # centroid row, pixels

    @property
    def colour(self) -> str:
        return COLOURS[int(self.colour_fractions.argmax())]


@lru_cache(maxsize=8)
def _pixel_coordinates(height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = np.indices((height, width), dtype=np.float64)
    return rows.ravel(), cols.ravel()


def detect_objects(classes: np.ndarray) -> list[Detection]:
    """The object-like components of one image's class map [H, W]."""
    height, width = classes.shape
    scale = min(height, width) / 64.0
    foreground = classes >= 0
    labels, count = ndimage.label(foreground)
    if count == 0:
        return []
    flat = labels.ravel()
    areas = np.bincount(flat, minlength=count + 1)
    interior = np.bincount(
        flat, weights=ndimage.binary_erosion(foreground).ravel(), minlength=count + 1
    )
    band_scale = min(1.0, scale)
    lo, hi = (t * band_scale for t in INTERIOR_BAND_AT_64)
    rows, cols = _pixel_coordinates(height, width)
    sum_y = np.bincount(flat, weights=rows, minlength=count + 1)
    sum_x = np.bincount(flat, weights=cols, minlength=count + 1)
    n_colours = len(COLOURS)
    colour_counts = np.bincount(
        flat * n_colours + np.maximum(classes.ravel(), 0), minlength=(count + 1) * n_colours
    ).reshape(count + 1, n_colours)
    detections = []
    for index, box in enumerate(ndimage.find_objects(labels), start=1):
        area = int(areas[index])
        if area < MIN_AREA_AT_64 * scale * scale:
            continue
        h = box[0].stop - box[0].start
        w = box[1].stop - box[1].start
        extent = max(h, w) / scale
        fill = area / (h * w)
        fractions = colour_counts[index] / area
        cy = float(sum_y[index] / area) + 0.5
        if extent > MAX_EXTENT_AT_64 or fill < MIN_FILL or fractions.max() < MIN_PURITY:
            continue
        objectness = min(1.0, (interior[index] / area - lo) / (hi - lo))
        if objectness <= 0:
            continue
        detections.append(
            Detection(
                colour_fractions=fractions,
                area=area,
                extent=extent,
                fill=fill,
                aspect=min(h, w) / max(h, w),
                objectness=float(objectness),
                depth=(cy - box[0].start) / h,
                cx=float(sum_x[index] / area) + 0.5,
                cy=cy,
            )
        )
    return detections
