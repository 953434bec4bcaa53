"""Render a shapes-world scene: flat-coloured objects on a plain light background.

Objects are axis-aligned (squares, discs, upward triangles) with hard edges, at least 4 pixels
apart so that each one is its own connected component. Positions and relations are realised by
giving each group a region of the canvas: a half for a position, two sides of a random split line
for a relation, so every object of "A left of B" lies left of every object of B.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chunk_grpo.shapes.grammar import Scene, ShapeObject

BACKGROUND = (245, 245, 245)
# Saturated colours about 60 degrees of hue apart, so hue alone tells them apart.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "yellow": (230, 210, 20),
    "green": (30, 170, 50),
    "cyan": (20, 190, 205),
    "blue": (40, 70, 225),
    "purple": (160, 40, 210),
}
# Side of the bounding box at 64x64; scaled with the canvas size.
EXTENT_AT_64 = {"small": 10, "large": 16}
GAP_AT_64 = 4  # background pixels between objects: blurry generated edges still leave a gap
_MAX_TRIES = 200


@dataclass(frozen=True)
class PlacedObject:
    shape: str
    colour: str
    size: str
    x0: int  # left column of the bounding box
    y0: int  # top row of the bounding box
    extent: int  # side of the square bounding box

    @property
    def centre(self) -> tuple[float, float]:
        return self.x0 + self.extent / 2, self.y0 + self.extent / 2


def object_extent(size_word: str, canvas: int) -> int:
    return max(4, round(EXTENT_AT_64[size_word] * canvas / 64))


def object_gap(canvas: int) -> int:
    return max(2, round(GAP_AT_64 * canvas / 64))


def _group_regions(scene: Scene, size: int, rng: np.random.Generator) -> list[tuple]:
    """(x_lo, x_hi, y_lo, y_hi) per group: the box its objects must lie in (hi exclusive)."""
    full = (1, size - 1, 1, size - 1)
    half = size // 2
    if scene.position is not None:
        return [
            {
                "left": (1, half - 1, 1, size - 1),
                "right": (half + 1, size - 1, 1, size - 1),
                "top": (1, size - 1, 1, half - 1),
                "bottom": (1, size - 1, half + 1, size - 1),
            }[scene.position]
        ]
    if scene.relation is None:
        return [full]
    a, b = scene.objects
    # The split line leaves room in proportion to the counts, jittered, never a too-thin side.
    margin = object_extent("large", size) + 4
    split = size * a.count / (a.count + b.count) + rng.integers(-size // 16, size // 16 + 1)
    split = int(np.clip(round(split), margin, size - margin))
    gap = object_gap(size)
    first = (1, split - gap // 2)
    second = (split + gap - gap // 2, size - 1)
    if scene.relation in ("right of", "below"):
        first, second = second, first
    if scene.relation in ("left of", "right of"):
        return [(*first, 1, size - 1), (*second, 1, size - 1)]
    return [(1, size - 1, *first), (1, size - 1, *second)]


def _overlaps(x0: int, y0: int, extent: int, placed: list[PlacedObject], gap: int) -> bool:
    for other in placed:
        if (
            x0 < other.x0 + other.extent + gap
            and other.x0 < x0 + extent + gap
            and y0 < other.y0 + other.extent + gap
            and other.y0 < y0 + extent + gap
        ):
            return True
    return False


def _place_group(
    group: ShapeObject, region: tuple, size: int, rng: np.random.Generator
) -> list[PlacedObject]:
    x_lo, x_hi, y_lo, y_hi = region
    extent = object_extent(group.size, size)
    if x_hi - x_lo < extent or y_hi - y_lo < extent:
        raise ValueError(f"a {group.size} object does not fit in region {region} at size {size}")
    for _ in range(_MAX_TRIES):
        placed: list[PlacedObject] = []
        for _ in range(group.count):
            for _ in range(_MAX_TRIES):
                x0 = int(rng.integers(x_lo, x_hi - extent + 1))
                y0 = int(rng.integers(y_lo, y_hi - extent + 1))
                if not _overlaps(x0, y0, extent, placed, object_gap(size)):
                    placed.append(
                        PlacedObject(group.shape, group.colour, group.size, x0, y0, extent)
                    )
                    break
            else:
                break  # this object found no room: start the group again
        if len(placed) == group.count:
            return placed
    raise ValueError(
        f"could not place {group.count} {group.size} objects in region {region}; "
        f"use a larger canvas than {size}"
    )


def layout_scene(scene: Scene, size: int = 64, rng=None) -> list[PlacedObject]:
    """Where each object of the scene goes. Same rng seed, same layout."""
    if size < 32:
        raise ValueError(f"size must be at least 32 pixels, got {size}")
    rng = _as_generator(rng)
    regions = _group_regions(scene, size, rng)
    placed: list[PlacedObject] = []
    for group, region in zip(scene.objects, regions, strict=True):
        placed.extend(_place_group(group, region, size, rng))
    return placed


def _shape_mask(shape: str, extent: int) -> np.ndarray:
    """Boolean [extent, extent] mask of the shape inside its bounding box (pixel centres)."""
    centres = np.arange(extent) + 0.5
    ys, xs = np.meshgrid(centres, centres, indexing="ij")
    half = extent / 2
    if shape == "square":
        return np.ones((extent, extent), dtype=bool)
    if shape == "circle":
        return (xs - half) ** 2 + (ys - half) ** 2 <= half**2
    if shape == "triangle":  # apex at the top, base on the bottom row
        return np.abs(xs - half) <= half * ys / extent + 0.25
    raise ValueError(f"unknown shape {shape!r}")


def draw_objects(objects: list[PlacedObject], size: int = 64) -> np.ndarray:
    """uint8 [size, size, 3] image of the placed objects on the background."""
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    for obj in objects:
        mask = _shape_mask(obj.shape, obj.extent)
        window = image[obj.y0 : obj.y0 + obj.extent, obj.x0 : obj.x0 + obj.extent]
        window[mask] = PALETTE[obj.colour]
    return image


def render_scene(scene: Scene, size: int = 64, rng=None) -> np.ndarray:
    """uint8 [size, size, 3] image of the scene; rng: a Generator, an int seed, or None (seed 0)."""
    return draw_objects(layout_scene(scene, size, rng), size)


def _as_generator(rng) -> np.random.Generator:
    if rng is None:
        return np.random.default_rng(0)
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)):
        return np.random.default_rng(int(rng))
    raise ValueError(f"rng must be a numpy Generator, an int seed or None, got {type(rng)}")
