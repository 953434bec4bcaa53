"""The `shapes` reward: how well an image shows its shapes-world prompt, in [0, 1].

Each expected object is matched to one detected object (Hungarian assignment on similarity).
Similarity gives partial credit, so the score rises smoothly as an image gets more right:

    sim = objectness * (0.1 + 0.45 (0.4 colour + 0.4 shape + 0.2 size) + 0.45 colour*shape*size)

The product term rewards binding: the right colour on the right shape, which is what the held-out
colour+shape compositions test; the sum keeps credit for each attribute on its own.

objectness = how solid the blob is (1 for any filled shape, 0 for ragged noise); colour = share
of the object's pixels of the asked colour; shape and size are soft memberships (full credit near
the rendered values, none at the neighbours'): triangle from how low the centroid sits in the
bounding box, square vs circle from the box fill ratio, size from the extent.
    objects = sum of matched sims / max(expected objects, sum of detected objectness)
so a missing and an extra object both cost. With a position or relation,
    score = 0.7 objects + 0.3 spatial
where spatial averages a soft "is it on the asked side", weighted by the match similarity, over
the objects (position) or all pairs of the two groups (relation); unmatched objects score 0.

`details()` also returns hard per-attribute accuracies for evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from chunk_grpo.rewards.registry import register_reward
from chunk_grpo.rewards.shapes_analysis import Detection, classify_pixels, detect_objects
from chunk_grpo.shapes.grammar import COLOURS, SHAPES, Scene, ShapeObject, parse_prompt

LARGE_THRESHOLD = 13.0  # extent at 64x64 between small (10) and large (16)
# Object similarity: presence, attributes one by one, and all at once (binding).
W_PRESENT, W_ATTRIBUTES, W_BOUND = 0.1, 0.45, 0.45
ATTRIBUTE_WEIGHTS = {"colour": 0.4, "shape": 0.4, "size": 0.2}
W_SPATIAL = 0.3
DETAIL_KEYS = ("colour_acc", "shape_acc", "size_acc", "count_acc", "spatial_acc", "exact")


def _ramp(value: float, zero_at: float, full_at: float) -> float:
    return float(min(1.0, max(0.0, (value - zero_at) / (full_at - zero_at))))


def _mean(values: list) -> float:
    return sum(values) / len(values)


def _triangle_likeness(det: Detection) -> float:
    """1 when the mass sits low in the box like an upward triangle's (0.64), 0 when centred."""
    return _ramp(det.depth, 0.53, 0.58)


def _square_likeness(det: Detection) -> float:
    """Among centred shapes: 1 for a filled box (square), 0 for a disc (fill 0.8)."""
    return _ramp(det.fill, 0.87, 0.92)


def shape_credit(det: Detection, shape: str) -> float:
    triangle = _triangle_likeness(det)
    if shape == "triangle":
        credit = triangle
    elif shape == "square":
        credit = (1.0 - triangle) * _square_likeness(det)
    else:  # circle: a centred, not box-filling blob that is not a thin shape either
        credit = (1.0 - triangle) * (1.0 - _square_likeness(det)) * _ramp(det.fill, 0.5, 0.62)
    return credit * _ramp(det.aspect, 0.5, 0.75)  # elongated blobs are none of the shapes


def shape_label(det: Detection) -> str:
    """The hard shape decision, for accuracies: the shape of highest credit."""
    credits = {shape: shape_credit(det, shape) for shape in SHAPES}
    best = max(credits, key=credits.get)
    return best if credits[best] >= 0.5 else "other"


def size_credit(det: Detection, size: str) -> float:
    if size == "small":
        return _ramp(-det.extent, -15.0, -11.0)
    return min(_ramp(det.extent, 11.0, 15.0), _ramp(-det.extent, -24.0, -20.0))


def similarity(det: Detection, group: ShapeObject) -> float:
    colour = float(det.colour_fractions[COLOURS.index(group.colour)])
    shape = shape_credit(det, group.shape)
    size = size_credit(det, group.size)
    w = ATTRIBUTE_WEIGHTS
    each = w["colour"] * colour + w["shape"] * shape + w["size"] * size
    return det.objectness * (W_PRESENT + W_ATTRIBUTES * each + W_BOUND * colour * shape * size)


def _solid(det: Detection | None) -> bool:
    return det is not None and det.objectness >= 0.5


def _is(det: Detection, colour: str, shape: str) -> bool:
    """Hard decision: a solid object of this colour and shape."""
    return _solid(det) and det.colour == colour and shape_label(det) == shape


@dataclass(frozen=True)
class ScoreBreakdown:
    score: float
    colour_acc: float
    shape_acc: float
    size_acc: float
    count_acc: float
    spatial_acc: float  # NaN when the prompt has no position or relation
    exact: float  # 1.0 when everything is right (hard criteria)


def _side_offset(det: Detection, position: str, width: int, height: int) -> float:
    """Signed distance (pixels at 64) of the centroid from the midline, positive = right side."""
    if position in ("left", "right"):
        offset = det.cx - width / 2
        offset = -offset if position == "left" else offset
        return offset * 64 / width
    offset = det.cy - height / 2
    offset = -offset if position == "top" else offset
    return offset * 64 / height


def _relation_offset(a: Detection, b: Detection, relation: str, width: int, height: int) -> float:
    """Signed distance (pixels at 64) by which a is on the asked side of b."""
    if relation == "left of":
        return (b.cx - a.cx) * 64 / width
    if relation == "right of":
        return (a.cx - b.cx) * 64 / width
    if relation == "above":
        return (b.cy - a.cy) * 64 / height
    return (a.cy - b.cy) * 64 / height


def score_scene(
    scene: Scene, detections: list[Detection], width: int, height: int
) -> ScoreBreakdown:
    groups = [g for g in scene.objects for _ in range(g.count)]
    group_of = [i for i, g in enumerate(scene.objects) for _ in range(g.count)]
    n_exp, n_det = len(groups), len(detections)
    match: list[Detection | None] = [None] * n_exp
    match_sim = [0.0] * n_exp
    if n_det:
        sims = np.array([[similarity(d, g) for d in detections] for g in groups])
        rows, cols = linear_sum_assignment(sims, maximize=True)
        for r, c in zip(rows, cols, strict=True):
            match[r] = detections[c]
            match_sim[r] = float(sims[r, c])
    object_score = sum(match_sim) / max(n_exp, sum(d.objectness for d in detections))

    # Spatial: per object (position) or pair (relation), "on the asked side" times how well the
    # objects involved match, so the right objects in the right places earn it; and its hard
    # version for the breakdown.
    soft: list[float] = []
    hard: list[bool] = []
    if scene.position is not None:
        for det, sim in zip(match, match_sim, strict=True):
            offset = -math.inf if det is None else _side_offset(det, scene.position, width, height)
            soft.append(_ramp(offset, -2.0, 4.0) * sim)
            hard.append(offset > 0)
    elif scene.relation is not None:
        for i in range(n_exp):
            for j in range(n_exp):
                if group_of[i] == 0 and group_of[j] == 1:
                    a, b = match[i], match[j]
                    offset = (
                        -math.inf
                        if a is None or b is None
                        else _relation_offset(a, b, scene.relation, width, height)
                    )
                    soft.append(_ramp(offset, 0.0, 6.0) * min(match_sim[i], match_sim[j]))
                    hard.append(offset > 0)
    score = object_score
    if soft:
        score = (1 - W_SPATIAL) * object_score + W_SPATIAL * _mean(soft)

    # Hard accuracies count only solid matches (objectness >= 0.5).
    pairs = [(d, g) for d, g in zip(match, groups, strict=True)]
    colour_ok = [_solid(d) and d.colour == g.colour for d, g in pairs]
    shape_ok = [_solid(d) and shape_label(d) == g.shape for d, g in pairs]
    size_ok = [_solid(d) and (d.extent >= LARGE_THRESHOLD) == (g.size == "large") for d, g in pairs]
    count_ok = [
        sum(_is(d, g.colour, g.shape) for d in detections) == g.count for g in scene.objects
    ]
    n_solid = sum(_solid(d) for d in detections)
    exact = n_solid == n_exp and all(colour_ok + shape_ok + size_ok + count_ok + hard)
    return ScoreBreakdown(
        score=float(min(1.0, max(0.0, score))),
        colour_acc=_mean(colour_ok),
        shape_acc=_mean(shape_ok),
        size_acc=_mean(size_ok),
        count_acc=_mean(count_ok),
        spatial_acc=_mean(hard) if hard else math.nan,
        exact=float(exact),
    )


@lru_cache(maxsize=4096)
def _parse_cached(prompt: str) -> Scene:
    return parse_prompt(prompt)


def _check_images(images: torch.Tensor, n_prompts: int) -> torch.Tensor:
    """float32 CPU [B, 3, H, W], NaN read as grey."""
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"images must be a torch.Tensor [B, 3, H, W], got {type(images).__name__}")
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must have shape [B, 3, H, W], got {tuple(images.shape)}")
    if images.shape[0] != n_prompts:
        raise ValueError(f"got {images.shape[0]} images but {n_prompts} prompts; pass one each")
    return images.detach().to("cpu", torch.float32).nan_to_num(0.5)


@register_reward("shapes")
class ShapesReward:
    """Callable reward for the shapes world; see the module docstring for the formula."""

    def breakdown(self, images: torch.Tensor, prompts: list[str]) -> list[ScoreBreakdown]:
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list of str, one per image, not a single str")
        prompts = list(prompts)
        scenes = [_parse_cached(p) for p in prompts]  # parse first: bad prompts fail fast
        images = _check_images(images, len(prompts))
        height, width = images.shape[2:]
        classes = classify_pixels(images)
        return [
            score_scene(scene, detect_objects(cls), width, height)
            for scene, cls in zip(scenes, classes, strict=True)
        ]

    def check_prompts(self, prompts: list[str]) -> None:
        """Raise PromptError (a ValueError) for a prompt outside the shapes grammar; a run checks
        its prompt sets with this before it starts."""
        for prompt in prompts:
            _parse_cached(prompt)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        scores = [b.score for b in self.breakdown(images, prompts)]
        return torch.tensor(scores, dtype=torch.float32)

    def details(self, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Per-image "score" plus hard accuracies DETAIL_KEYS (spatial_acc NaN if not asked)."""
        rows = self.breakdown(images, prompts)
        out = {"score": torch.tensor([b.score for b in rows], dtype=torch.float32)}
        for key in DETAIL_KEYS:
            out[key] = torch.tensor([getattr(b, key) for b in rows], dtype=torch.float32)
        return out
