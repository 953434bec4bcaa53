"""`python -m chunk_grpo.evaluate_clip`: the `chunk-grpo evaluate-clip` command
(`chunk_grpo.cli.evaluate_clip`)."""

from chunk_grpo.cli.main import run

if __name__ == "__main__":
    run("evaluate-clip")
