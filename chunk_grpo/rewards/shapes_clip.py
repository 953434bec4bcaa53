"""`shapes-clip`: the `clip` reward on the project's own tiny CLIP of the shapes world.

The checkpoint (`chunk_grpo/assets/shapes-clip`, made by `python -m chunk_grpo.pretrain_clip`) is
an ordinary transformers CLIPModel directory with its tokenizer and preprocessor_config.json, so
it is loaded and scored by the very code that scores real CLIP checkpoints: every run on the
embedded default exercises the real loading path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from chunk_grpo.rewards.clip_score import ClipScore
from chunk_grpo.rewards.registry import register_reward

SHAPES_CLIP_DIR = Path(__file__).resolve().parent.parent / "assets" / "shapes-clip"


@register_reward("shapes-clip")
def shapes_clip(*, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                batch_size: int = 64) -> ClipScore:
    """exp(logit_scale) * cos(image, prompt) under the shipped shapes-world CLIP."""
    return ClipScore(SHAPES_CLIP_DIR, device=device, dtype=dtype, batch_size=batch_size)
