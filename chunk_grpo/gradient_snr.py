"""`python -m chunk_grpo.gradient_snr`: the `chunk-grpo gradient-snr` command
(`chunk_grpo.cli.gradient_snr`)."""

from chunk_grpo.cli.main import run

if __name__ == "__main__":
    run("gradient-snr")
