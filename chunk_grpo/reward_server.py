"""`python -m chunk_grpo.reward_server`: the `chunk-grpo reward-server` command
(`chunk_grpo.cli.reward_server`)."""

from chunk_grpo.cli.main import run

if __name__ == "__main__":
    run("reward-server")
