"""`python -m chunk_grpo.cli <command> [flags]`: `chunk-grpo` without its console script."""

from chunk_grpo.cli.main import main

if __name__ == "__main__":
    main()
