"""Captioned renders for contrastive training: each scene's image, its caption, and captions of
the same scene with one attribute changed (hard negatives that teach attribute binding).

A changed caption must be FALSE for the image, not merely different, so:
- position: the opposite half ("on the left" -> "on the right"), never a perpendicular one (objects
  on the left may also happen to sit at the top);
- relation: the opposite relation with the groups kept in order ("A above B" -> "A below B");
  swapping the groups ("B below A") would describe the same image;
- colour: a new colour for one group, or (with two groups of different colours) the two groups'
  colours swapped, the binding error a bag-of-words model cannot see;
- shape, size, count: a new value for one group, within the grammar's limits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from chunk_grpo.shapes.grammar import (
    COLOURS,
    COUNT_WORDS,
    MAX_OBJECTS,
    MAX_POSITIONED_COUNT,
    SHAPES,
    SIZES,
    PromptError,
    Scene,
    random_scene,
    scene_to_prompt,
)
from chunk_grpo.shapes.render import render_scene

ATTRIBUTES = ("colour", "shape", "count", "size", "position")
_OPPOSITE = {
    "left": "right", "right": "left", "top": "bottom", "bottom": "top",
    "left of": "right of", "right of": "left of", "above": "below", "below": "above",
}


def _with_group(scene: Scene, index: int, **changes) -> Scene:
    groups = list(scene.objects)
    groups[index] = dataclasses.replace(groups[index], **changes)
    return dataclasses.replace(scene, objects=tuple(groups))


def _candidates(scene: Scene, attribute: str) -> list[Scene]:
    """Every scene that differs from `scene` in `attribute` only (invalid ones are dropped)."""
    if attribute == "position":
        if scene.position is not None:
            return [dataclasses.replace(scene, position=_OPPOSITE[scene.position])]
        if scene.relation is not None:
            return [dataclasses.replace(scene, relation=_OPPOSITE[scene.relation])]
        return []
    values = {"colour": COLOURS, "shape": SHAPES, "size": SIZES, "count": tuple(COUNT_WORDS)}
    if attribute not in values:
        raise ValueError(f"attribute must be one of {ATTRIBUTES}, got {attribute!r}")
    limit = MAX_POSITIONED_COUNT if scene.position is not None else MAX_OBJECTS
    out = []
    for index, group in enumerate(scene.objects):
        for value in values[attribute]:
            if value == getattr(group, attribute):
                continue
            if attribute == "count" and scene.num_objects - group.count + value > limit:
                continue
            try:
                out.append(_with_group(scene, index, **{attribute: value}))
            except PromptError:  # e.g. both groups would become the same colour+shape
                continue
    return out


def _colour_swap(scene: Scene) -> Scene | None:
    """The two groups' colours exchanged, or None (one group, equal colours, or invalid)."""
    if len(scene.objects) != 2 or scene.objects[0].colour == scene.objects[1].colour:
        return None
    a, b = scene.objects
    try:
        return _with_group(_with_group(scene, 0, colour=b.colour), 1, colour=a.colour)
    except PromptError:
        return None


def perturb_scene(scene: Scene, attribute: str, rng: np.random.Generator) -> Scene | None:
    """`scene` with `attribute` (one of ATTRIBUTES) changed so that its caption is false for the
    scene's image; None when the attribute cannot change (a position on an unplaced group)."""
    if attribute == "colour":
        swapped = _colour_swap(scene)
        if swapped is not None and rng.random() < 0.5:
            return swapped
    candidates = _candidates(scene, attribute)
    if not candidates:
        return None
    return candidates[int(rng.integers(len(candidates)))]


def applicable_attributes(scene: Scene) -> list[str]:
    return [a for a in ATTRIBUTES if _candidates(scene, a)]


@dataclass
class CaptionedBatch:
    """images: uint8 [N, size, size, 3]; captions[i] describes image i; negatives[i] are K false
    captions of image i, negative_attributes[i] the attribute each one changes."""

    images: np.ndarray
    captions: list[str]
    negatives: list[list[str]]
    negative_attributes: list[list[str]]


def captioned_batch(
    rng: np.random.Generator,
    count: int,
    *,
    negatives: int,
    split: str = "all",
    size: int = 64,
) -> CaptionedBatch:
    """`count` random scenes rendered, captioned, each with `negatives` one-attribute changes
    (the attributes cycle through the applicable ones in a random order, so up to five distinct
    attributes per scene)."""
    images = np.empty((count, size, size, 3), dtype=np.uint8)
    captions, false_captions, attributes = [], [], []
    for i in range(count):
        scene = random_scene(rng, split=split)
        images[i] = render_scene(scene, size=size, rng=rng)
        captions.append(scene_to_prompt(scene))
        order = list(rng.permutation(applicable_attributes(scene)))
        chosen = [str(order[j % len(order)]) for j in range(negatives)]
        attributes.append(chosen)
        false_captions.append([scene_to_prompt(perturb_scene(scene, a, rng)) for a in chosen])
    return CaptionedBatch(images, captions, false_captions, attributes)
