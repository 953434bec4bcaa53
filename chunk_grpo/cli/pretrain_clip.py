"""`chunk-grpo pretrain-clip` (``python -m chunk_grpo.pretrain_clip``): pretrain a tiny CLIP on
the shapes world; the training (and its flags, which name its model sizes) is
`chunk_grpo.pretrain.clip`."""

from __future__ import annotations

import os

PROG = "python -m chunk_grpo.pretrain_clip"


def main(argv: list[str] | None = None, prog: str = PROG) -> dict:
    # Idle OpenMP threads must sleep, not spin: set before torch starts its thread pool.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from chunk_grpo.pretrain.clip import parse_args, run  # its flags name its model sizes

    args = parse_args(argv, prog=prog)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)
