"""The prompt grammar of the shapes world: scenes, parsing, printing, random sampling.

A scene is one or two groups of identical objects (1 to 4 objects in all):

    single:    "<group>"                     "three small red circles"
    position:  "<group> <position>"          "a large blue square on the left"
    relation:  "<group> <relation> <group>"  "two small red circles above a large cyan square"

    <group>    = <count> <size> <colour> <shape>[s]
    <count>    = a | two | three | four
    <position> = on the left | on the right | at the top | at the bottom   (groups of 1 or 2)
    <relation> = to the left of | to the right of | above | below

Held-out compositions: the colour+shape pairs in HELDOUT_PAIRS. `random_scene(split="train")`
never produces them, `split="heldout"` always contains at least one. See GRAMMAR.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

SHAPES = ("circle", "square", "triangle")
COLOURS = ("red", "yellow", "green", "cyan", "blue", "purple")
SIZES = ("small", "large")
COUNT_WORDS = {1: "a", 2: "two", 3: "three", 4: "four"}
POSITIONS = ("left", "right", "top", "bottom")
RELATIONS = ("left of", "right of", "above", "below")
MAX_OBJECTS = 4
MAX_POSITIONED_COUNT = 2  # more objects do not fit in one half of a 64x64 canvas

# Colour+shape pairs never seen in training: one per shape, each with a different colour.
HELDOUT_PAIRS = frozenset({("red", "triangle"), ("green", "square"), ("blue", "circle")})

_POSITION_PHRASES = {
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
}
_RELATION_PHRASES = {
    "left of": "to the left of",
    "right of": "to the right of",
    "above": "above",
    "below": "below",
}

VOCABULARY: list[str] = sorted(
    set(COUNT_WORDS.values())
    | set(SIZES)
    | set(COLOURS)
    | set(SHAPES)
    | {shape + "s" for shape in SHAPES}
    | {w for phrase in _POSITION_PHRASES.values() for w in phrase.split()}
    | {w for phrase in _RELATION_PHRASES.values() for w in phrase.split()}
)

SPLITS = ("train", "heldout", "all")


class PromptError(ValueError):
    """A prompt (or scene) outside the shapes grammar."""


@dataclass(frozen=True)
class ShapeObject:
    """A group of `count` identical objects."""

    shape: str
    colour: str
    size: str
    count: int = 1

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise PromptError(f"shape {self.shape!r} is not one of {SHAPES}")
        if self.colour not in COLOURS:
            raise PromptError(f"colour {self.colour!r} is not one of {COLOURS}")
        if self.size not in SIZES:
            raise PromptError(f"size {self.size!r} is not one of {SIZES}")
        if self.count not in COUNT_WORDS:
            raise PromptError(f"count {self.count!r} must be 1 to {MAX_OBJECTS}")

    @property
    def is_heldout(self) -> bool:
        return (self.colour, self.shape) in HELDOUT_PAIRS


@dataclass(frozen=True)
class Scene:
    """One group (optionally placed in a half of the canvas) or two groups in a relation.

    With a relation, it reads "objects[0] <relation> objects[1]".
    """

    objects: tuple[ShapeObject, ...]
    relation: str | None = None
    position: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "objects", tuple(self.objects))
        n_groups = len(self.objects)
        if n_groups not in (1, 2):
            raise PromptError(f"a scene has 1 or 2 groups of objects, got {n_groups}")
        if self.num_objects > MAX_OBJECTS:
            raise PromptError(f"a scene has at most {MAX_OBJECTS} objects, got {self.num_objects}")
        if n_groups == 2:
            if self.relation not in RELATIONS:
                raise PromptError(f"two groups need a relation from {RELATIONS}")
            if self.position is not None:
                raise PromptError("a position is only allowed with a single group")
            a, b = self.objects
            if (a.colour, a.shape) == (b.colour, b.shape):
                raise PromptError("the two groups of a relation must differ in colour or shape")
        else:
            if self.relation is not None:
                raise PromptError("a relation needs two groups")
            if self.position is not None:
                if self.position not in POSITIONS:
                    raise PromptError(f"position {self.position!r} is not one of {POSITIONS}")
                if self.objects[0].count > MAX_POSITIONED_COUNT:
                    raise PromptError(
                        f"a positioned group has at most {MAX_POSITIONED_COUNT} objects"
                    )

    @property
    def num_objects(self) -> int:
        return sum(group.count for group in self.objects)

    @property
    def is_heldout(self) -> bool:
        return any(group.is_heldout for group in self.objects)


def _group_to_text(group: ShapeObject) -> str:
    noun = group.shape + ("s" if group.count > 1 else "")
    return f"{COUNT_WORDS[group.count]} {group.size} {group.colour} {noun}"


def scene_to_prompt(scene: Scene) -> str:
    text = _group_to_text(scene.objects[0])
    if scene.position is not None:
        text += " " + _POSITION_PHRASES[scene.position]
    if scene.relation is not None:
        text += f" {_RELATION_PHRASES[scene.relation]} {_group_to_text(scene.objects[1])}"
    return text


_COUNT_BY_WORD = {word: count for count, word in COUNT_WORDS.items()}
_GROUP = r"(a|two|three|four) (\w+) (\w+) (\w+)"
_POSITION_BY_PHRASE = {phrase: pos for pos, phrase in _POSITION_PHRASES.items()}
_RELATION_BY_PHRASE = {phrase: rel for rel, phrase in _RELATION_PHRASES.items()}
_PROMPT_RE = re.compile(
    rf"^{_GROUP}"
    rf"(?: ({'|'.join(_POSITION_BY_PHRASE)}))?"
    rf"(?: ({'|'.join(_RELATION_BY_PHRASE)}) {_GROUP})?$"
)


def _parse_group(count_word: str, size: str, colour: str, noun: str, prompt: str) -> ShapeObject:
    count = _COUNT_BY_WORD[count_word]
    shape = noun[:-1] if count > 1 and noun.endswith("s") else noun
    if count > 1 and not noun.endswith("s"):
        raise PromptError(f"{prompt!r}: count {count_word!r} needs a plural noun, got {noun!r}")
    if count == 1 and noun.endswith("s"):
        raise PromptError(f"{prompt!r}: 'a' needs a singular noun, got {noun!r}")
    try:
        return ShapeObject(shape=shape, colour=colour, size=size, count=count)
    except PromptError as err:
        raise PromptError(f"{prompt!r}: {err} (word order: count size colour shape)") from None


def parse_prompt(prompt: str) -> Scene:
    """Parse a prompt of the grammar (case and extra spaces ignored) into a Scene."""
    if not isinstance(prompt, str):
        raise PromptError(f"prompt must be a str, got {type(prompt).__name__}")
    text = " ".join(prompt.lower().split())
    unknown = [w for w in text.split() if w not in VOCABULARY]
    if unknown:
        raise PromptError(
            f"{prompt!r}: words {unknown} are not in the shapes vocabulary "
            f"(see chunk_grpo.shapes.VOCABULARY)"
        )
    match = _PROMPT_RE.match(text)
    if match is None:
        raise PromptError(
            f"{prompt!r} does not follow the shapes grammar, e.g. 'two small red circles above "
            f"a large blue square' or 'a large green triangle on the left' (see GRAMMAR.md)"
        )
    g = match.groups()
    objects = [_parse_group(*g[0:4], prompt)]
    position = _POSITION_BY_PHRASE[g[4]] if g[4] else None
    relation = _RELATION_BY_PHRASE[g[5]] if g[5] else None
    if relation is not None:
        if position is not None:
            raise PromptError(f"{prompt!r}: a relation prompt cannot also have a position")
        objects.append(_parse_group(*g[6:10], prompt))
    try:
        return Scene(objects=tuple(objects), relation=relation, position=position)
    except PromptError as err:
        raise PromptError(f"{prompt!r}: {err}") from None


# Relation count pairs (a, b) with a + b <= 4; (1, 1) is weighted up as the common case.
_RELATION_COUNTS = ((1, 1), (1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (3, 1))
_FORM_PROBS = {"single": 0.3, "position": 0.3, "relation": 0.4}


def _random_group(rng: np.random.Generator, count: int) -> ShapeObject:
    return ShapeObject(
        shape=SHAPES[rng.integers(len(SHAPES))],
        colour=COLOURS[rng.integers(len(COLOURS))],
        size=SIZES[rng.integers(len(SIZES))],
        count=count,
    )


def _random_any_scene(rng: np.random.Generator) -> Scene:
    form = rng.choice(list(_FORM_PROBS), p=list(_FORM_PROBS.values()))
    if form == "single":
        return Scene(objects=(_random_group(rng, int(rng.integers(1, MAX_OBJECTS + 1))),))
    if form == "position":
        group = _random_group(rng, int(rng.integers(1, MAX_POSITIONED_COUNT + 1)))
        return Scene(objects=(group,), position=POSITIONS[rng.integers(len(POSITIONS))])
    count_a, count_b = _RELATION_COUNTS[rng.integers(len(_RELATION_COUNTS))]
    a = _random_group(rng, count_a)
    while True:
        b = _random_group(rng, count_b)
        if (a.colour, a.shape) != (b.colour, b.shape):
            break
    return Scene(objects=(a, b), relation=RELATIONS[rng.integers(len(RELATIONS))])


def random_scene(rng: np.random.Generator, *, split: str = "train") -> Scene:
    """A random scene: "train" never has a held-out colour+shape pair, "heldout" always has one."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not isinstance(rng, np.random.Generator):
        raise ValueError("rng must be a numpy.random.Generator, e.g. numpy.random.default_rng(0)")
    while True:
        scene = _random_any_scene(rng)
        if split == "all" or scene.is_heldout == (split == "heldout"):
            return scene
