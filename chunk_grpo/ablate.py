"""`python -m chunk_grpo.ablate`: the `chunk-grpo ablate` command (`chunk_grpo.cli.ablate`)."""

from chunk_grpo.cli.main import run

if __name__ == "__main__":
    run("ablate")
