"""`python -m chunk_grpo.train`: the `chunk-grpo train` command (`chunk_grpo.cli.train`)."""

from chunk_grpo.cli.main import run

if __name__ == "__main__":
    run("train")
