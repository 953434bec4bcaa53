"""`chunk-grpo evaluate-clip` (``python -m chunk_grpo.evaluate_clip``): how good a shapes-world
CLIP is as a reward; the measurements are `chunk_grpo.pretrain.clip_eval`."""

from __future__ import annotations

import json
from pathlib import Path

from chunk_grpo.config.cli_args import add_verbose, nonnegative_int, positive_int
from chunk_grpo.config.commands import EvaluateClipConfig
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import ConfigArgumentParser

PROG = "python -m chunk_grpo.evaluate_clip"

# The flags of earlier versions, for the error that names the key each became.
RENAMED = {"prompts": "data.eval_prompts"}

DESCRIPTION = """\
How good a shapes-world CLIP is as a reward, on data training never sees:
1. retrieval on held-out renders: image->text top-1 (the true caption against each of the
   image's captions with one attribute changed, also per attribute) and text->image top-1
   (each caption picks its own image among --group images);
2. the generator's images: model.name samples the first --num-prompts prompts of
   data.eval_prompts; the Spearman correlation between the CLIP score and the programmatic
   shapes reward on those images says whether the learned reward tracks prompt fidelity."""

# The shapes-clip shipped in the package (`chunk_grpo.pretrain.clip_eval.SHIPPED_CLIP`, which
# imports torch).
SHIPPED_CLIP = Path(__file__).resolve().parents[1] / "assets" / "shapes-clip"


def evaluate_clip_parser(prog: str = PROG) -> ConfigArgumentParser:
    p = ConfigArgumentParser(EvaluateClipConfig, prog, DESCRIPTION,
                             "%(prog)s [--clip DIR] [--section.key VALUE ...] [--out FILE]",
                             renamed=RENAMED)
    p.add_argument("--clip", default=str(SHIPPED_CLIP), metavar="DIR", help="CLIP directory")
    p.add_argument("--renders", type=positive_int, default=1024, metavar="N",
                   help="held-out renders for retrieval")
    p.add_argument("--group", type=positive_int, default=32, metavar="N",
                   help="text->image: images per group")
    p.add_argument("--num-prompts", type=nonnegative_int, default=64, metavar="N",
                   help="generated images' prompts; 0 skips the generated images")
    p.add_argument("--images-per-prompt", type=positive_int, default=1, metavar="N",
                   help="generated images per prompt")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="also write the metrics to this JSON")
    add_verbose(p)
    return p


def main(argv: list[str] | None = None, prog: str = PROG) -> dict:
    args, cfg = evaluate_clip_parser(prog).parse_config(argv)
    if args["renders"] < args["group"] or args["group"] < 2:
        raise ConfigError(f"--group must be >= 2 and --renders at least --group; got --group "
                          f"{args['group']} --renders {args['renders']}")
    import torch  # and the CLIP and FLUX models: only once the flags are good

    from chunk_grpo.config.cli_args import model_path
    from chunk_grpo.data.prompts import load_prompts
    from chunk_grpo.pretrain import clip_eval

    torch.manual_seed(0)
    clip = clip_eval.load_clip(args["clip"])
    metrics = clip_eval.evaluate_clip(clip, renders=args["renders"], group=args["group"])
    if args["num_prompts"] > 0:
        prompts = load_prompts(cfg.data.eval_prompts)[: args["num_prompts"]]
        metrics.update(clip_eval.generator_correlation(
            clip, model_path(cfg.model.name), prompts, seed=cfg.run.seed,
            images_per_prompt=args["images_per_prompt"]))
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    if args["out"] is not None:
        args["out"].write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
