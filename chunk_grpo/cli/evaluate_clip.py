"""`chunk-grpo evaluate-clip` (``python -m chunk_grpo.evaluate_clip``): how good a shapes-world
CLIP is as a reward; the measurements are `chunk_grpo.pretrain.clip_eval`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROG = "python -m chunk_grpo.evaluate_clip"


def main(argv: list[str] | None = None, prog: str = PROG) -> dict:
    import torch

    from chunk_grpo.models import EMBEDDED_MODEL
    from chunk_grpo.pretrain import clip_eval
    from chunk_grpo.shapes import HELDOUT_PROMPTS_FILE, load_prompts

    p = argparse.ArgumentParser(prog=prog, description=clip_eval.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clip", default=str(clip_eval.SHIPPED_CLIP), help="CLIP directory")
    p.add_argument("--renders", type=int, default=1024, help="held-out renders for retrieval")
    p.add_argument("--group", type=int, default=32, help="text->image: images per group")
    p.add_argument("--model", default=str(EMBEDDED_MODEL), help="FLUX model for generated images")
    p.add_argument("--prompts", default=str(HELDOUT_PROMPTS_FILE), help="prompt file")
    p.add_argument("--num-prompts", type=int, default=64, help="0 skips the generated images")
    p.add_argument("--images-per-prompt", type=int, default=1, help="generated images per prompt")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the generated images")
    p.add_argument("--out", type=Path, default=None, help="also write the metrics to this JSON")
    args = p.parse_args(argv)
    if args.renders < args.group or args.group < 2:
        p.error("--group must be >= 2 and --renders at least --group")
    if args.images_per_prompt < 1:
        p.error("--images-per-prompt must be >= 1")
    torch.manual_seed(0)
    clip = clip_eval.load_clip(args.clip)
    metrics = clip_eval.evaluate_clip(clip, renders=args.renders, group=args.group)
    if args.num_prompts > 0:
        prompts = load_prompts(args.prompts)[: args.num_prompts]
        metrics.update(clip_eval.generator_correlation(
            clip, args.model, prompts, seed=args.seed, images_per_prompt=args.images_per_prompt))
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    if args.out is not None:
        args.out.write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
