"""`python -m chunk_grpo.evaluate`: the `chunk-grpo evaluate` command
(`chunk_grpo.cli.evaluate`)."""

from chunk_grpo.cli.main import run

if __name__ == "__main__":
    run("evaluate")
