"""The sampling settings a model was trained for, stored next to its weights.

A FLUX diffusers directory says nothing about the image size, prompt length or CFG scale it
expects, yet sampling a model at another `max_sequence_length` than it was trained with gives
blank images. `chunk_grpo.json` in the model directory records them; a directory without it (e.g.
FLUX.1-dev) gets FLUX.1-dev's own defaults, except the image size: the commands refuse to guess it
(`apply_sampling_size`), since a silent 1024x1024 takes minutes per image on a CPU.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

CONFIG_NAME = "chunk_grpo.json"


@dataclass(frozen=True)
class SamplingDefaults:
    height: int = 1024
    width: int = 1024
    max_sequence_length: int = 512
    default_cfg_scale: float = 1.0  # true classifier-free guidance; 1.0 = off
    negative_prompt: str = ""  # the unconditional prompt used for CFG (caption dropout target)
    guidance_scale: float = 3.5  # embedded guidance; used only by guidance-distilled models
    num_steps: int = 16
    shift: float = 3.0

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / CONFIG_NAME
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> SamplingDefaults:
        """Read `chunk_grpo.json` from a model directory; FLUX.1-dev defaults when absent."""
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            return cls()
        data = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; valid keys: {sorted(known)}")
        return cls(**data)


def apply_sampling_size(policy, height: int | None, width: int | None, *, source: str,
                        found_file: bool,
                        how: str = "model.height and model.width (--model.height H "
                                   "--model.width W)") -> None:
    """Set the policy's image size from the user's height/width, or keep the size its
    chunk_grpo.json gives. Without either, raise ValueError saying which setting to give."""
    if height or width:
        if not (height and width) and not found_file:
            raise ValueError(f"give both model.height and model.width for {source} (it has no "
                             f"{CONFIG_NAME})")
        policy.height = height or policy.height
        policy.width = width or policy.width
        return
    if not found_file:
        raise ValueError(
            f"model {source} has no {CONFIG_NAME}, so its image size is unknown (FLUX.1-dev's "
            f"1024x1024 takes minutes per image on a CPU): set {how} (e.g. 1024 for FLUX.1-dev), "
            f"or write {CONFIG_NAME} beside the model with height, width and the other sampling "
            f"settings (see docs/guides/configuration.md)")
