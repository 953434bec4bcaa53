"""`python -m chunk_grpo.cache_prompts`: the `chunk-grpo cache-prompts` command
(`chunk_grpo.cli.cache_prompts`)."""

from chunk_grpo.cli.main import run

if __name__ == "__main__":
    run("cache-prompts")
