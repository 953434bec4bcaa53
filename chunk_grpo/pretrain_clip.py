"""`python -m chunk_grpo.pretrain_clip`: the `chunk-grpo pretrain-clip` command
(`chunk_grpo.cli.pretrain_clip`)."""

from chunk_grpo.cli.main import run

if __name__ == "__main__":
    run("pretrain-clip")
