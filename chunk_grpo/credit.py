"""`python -m chunk_grpo.credit`: the `chunk-grpo credit` command (`chunk_grpo.cli.credit`)."""

from chunk_grpo.cli.main import run

if __name__ == "__main__":
    run("credit")
