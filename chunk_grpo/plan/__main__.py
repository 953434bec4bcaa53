"""`python -m chunk_grpo.plan`: the `chunk-grpo plan` command (`chunk_grpo.cli.plan`)."""

from chunk_grpo.cli.main import run

if __name__ == "__main__":
    run("plan")
