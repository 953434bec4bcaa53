"""`chunk-grpo ablate` (``python -m chunk_grpo.ablate``): the chunk ablation (the paper's
Table 3) at toy scale; its cells, runs and table are `chunk_grpo.analysis.ablate`."""

from __future__ import annotations

from chunk_grpo.config.errors import RunInterrupted, interruption

PROG = "python -m chunk_grpo.ablate"


def main(argv: list[str] | None = None, prog: str = PROG) -> str:
    # the flags name the ablation's cells and defaults, which live with its runs
    from chunk_grpo.analysis.ablate import parse_ablation_args, run_ablation

    a = parse_ablation_args(argv, prog=prog)
    try:
        table = run_ablation(a.out, a.cells, a.seeds, a.base, a.minutes, a.eval_images,
                             a.eval_seed, trust_checkpoint=a.trust_checkpoint)
    except (KeyboardInterrupt, RunInterrupted) as err:
        status = err.status if isinstance(err, RunInterrupted) else interruption(err)[1]
        what = "SIGTERM" if status == 143 else "Ctrl-C"
        raise RunInterrupted(f"interrupted ({what}); rerun the same command to continue "
                             "(finished runs are kept, the interrupted one resumes)",
                             status) from None
    print(table, flush=True)
    written = [a.out / name for name in ("table.md", "curves.png") if (a.out / name).is_file()]
    print("wrote " + " and ".join(map(str, written)))
    return table
