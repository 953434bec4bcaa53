"""Regenerate the shipped prompt files: `python -m chunk_grpo.shapes.prompt_sets`.

Distinct prompts drawn from `random_scene` with fixed seeds, so the files are reproducible:
- train: the pretraining split (never a held-out colour+shape pair);
- heldout: the evaluation prompts (each has at least one held-out pair);
- rl: the RL training prompts, drawn from the whole grammar (so held-out pairs appear, as the
  compositions an RL stage is meant to fix) minus every evaluation prompt string.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from chunk_grpo.shapes import HELDOUT_PROMPTS_FILE, RL_PROMPTS_FILE, TRAIN_PROMPTS_FILE
from chunk_grpo.shapes.grammar import random_scene, scene_to_prompt


def distinct_prompts(count: int, *, split: str, seed: int,
                     exclude: frozenset[str] = frozenset()) -> list[str]:
    """`count` distinct prompts of `split` not in `exclude`, in the order first drawn."""
    rng = np.random.default_rng(seed)
    prompts: dict[str, None] = {}
    for _ in range(count * 1000):
        prompt = scene_to_prompt(random_scene(rng, split=split))
        if prompt not in exclude:
            prompts[prompt] = None
        if len(prompts) == count:
            return list(prompts)
    raise ValueError(f"split {split!r} has fewer than {count} distinct prompts")


def write_prompts(path: Path, prompts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(prompts) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train", type=int, default=2000, help="number of training prompts")
    parser.add_argument("--heldout", type=int, default=256, help="number of held-out prompts")
    parser.add_argument("--rl", type=int, default=2000, help="number of RL training prompts")
    args = parser.parse_args(argv)
    heldout = distinct_prompts(args.heldout, split="heldout", seed=1)
    write_prompts(TRAIN_PROMPTS_FILE, distinct_prompts(args.train, split="train", seed=0))
    write_prompts(HELDOUT_PROMPTS_FILE, heldout)
    write_prompts(RL_PROMPTS_FILE, distinct_prompts(args.rl, split="all", seed=2,
                                                    exclude=frozenset(heldout)))
    print(f"wrote {TRAIN_PROMPTS_FILE}, {HELDOUT_PROMPTS_FILE} and {RL_PROMPTS_FILE}")


if __name__ == "__main__":
    main()
