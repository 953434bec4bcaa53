"""The embedded shapes world: a prompt grammar, a renderer and the shipped prompt sets."""

from __future__ import annotations

from pathlib import Path

from chunk_grpo.shapes.grammar import (
    COLOURS,
    HELDOUT_PAIRS,
    POSITIONS,
    RELATIONS,
    SHAPES,
    SIZES,
    VOCABULARY,
    PromptError,
    Scene,
    ShapeObject,
    parse_prompt,
    random_scene,
    scene_to_prompt,
)
from chunk_grpo.shapes.render import BACKGROUND, PALETTE, layout_scene, render_scene

DATA_DIR = Path(__file__).parent / "data"
TRAIN_PROMPTS_FILE = DATA_DIR / "train_prompts.txt"
HELDOUT_PROMPTS_FILE = DATA_DIR / "heldout_prompts.txt"
RL_PROMPTS_FILE = DATA_DIR / "rl_prompts.txt"


def load_prompts(path: str | Path) -> list[str]:
    """Non-empty, stripped lines of a prompt file (lines starting with '#' are comments)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {str(path)!r} does not exist")
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in lines if line and not line.startswith("#")]
    if not prompts:
        raise ValueError(f"prompt file {str(path)!r} has no prompts")
    return prompts


__all__ = [
    "BACKGROUND",
    "COLOURS",
    "DATA_DIR",
    "HELDOUT_PAIRS",
    "HELDOUT_PROMPTS_FILE",
    "PALETTE",
    "POSITIONS",
    "RELATIONS",
    "SHAPES",
    "SIZES",
    "TRAIN_PROMPTS_FILE",
    "VOCABULARY",
    "RL_PROMPTS_FILE",
    "PromptError",
    "Scene",
    "ShapeObject",
    "layout_scene",
    "load_prompts",
    "parse_prompt",
    "random_scene",
    "render_scene",
    "scene_to_prompt",
]
