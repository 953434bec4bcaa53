"""`python -m chunk_grpo.gpu_check`: the `chunk-grpo gpu-check` command
(`chunk_grpo.cli.gpu_check`)."""

from chunk_grpo.cli.main import run

if __name__ == "__main__":
    run("gpu-check")
