"""`python -m chunk_grpo.profile`: the `chunk-grpo profile` command (`chunk_grpo.cli.profile`)."""

from chunk_grpo.cli.main import run

if __name__ == "__main__":
    run("profile")
