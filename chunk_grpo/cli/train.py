"""`chunk-grpo train` (``python -m chunk_grpo.train``): fine-tune a model with Chunk-GRPO.

The flags and the configuration they build are checked before torch is imported: ``--help``, a
misspelt key or a bad value answer at once. The run itself is `chunk_grpo.train.loop.run`.
"""

from __future__ import annotations

from pathlib import Path

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config, load_yaml, parse_args

PROG = "python -m chunk_grpo.train"


def main(argv: list[str] | None = None, prog: str = PROG) -> Path:
    yaml_path, overrides, resume, trust = parse_args(argv, prog=prog, trust_flag=True)
    if resume:
        run_dir = Path(resume)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume {resume}: no config.yaml there; give the run directory")
        if not load_yaml(run_dir / "config.yaml"):
            raise ConfigError(f"--resume {resume}: its config.yaml is empty; "
                              "restore it (its checkpoints were saved with it)")
        # The saved config (from any version: `migrate_saved`), then the flags.
        cfg = build_config(run_dir / "config.yaml", overrides, saved=True)
    else:
        if trust:
            raise ConfigError("--trust-checkpoint goes with --resume DIR (it lets a checkpoint "
                              "without a manifest be resumed)")
        # No --config: the dataclass defaults, which configs/default.yaml spells out.
        cfg = build_config(yaml_path, overrides)
    from chunk_grpo.runtime import distributed as D  # torch: only once the config is good
    from chunk_grpo.train.loop import run

    if resume:
        out = run(cfg, run_dir=Path(resume), resume=True, trust_checkpoint=trust)
    else:
        out = run(cfg)
    D.cleanup()  # the command's process group, if torchrun started one
    return out
