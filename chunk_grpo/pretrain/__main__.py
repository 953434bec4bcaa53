"""`python -m chunk_grpo.pretrain`: the `chunk-grpo pretrain` command
(`chunk_grpo.cli.pretrain`)."""

from chunk_grpo.cli.main import run

if __name__ == "__main__":
    run("pretrain")
