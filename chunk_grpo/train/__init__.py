"""A training run: setup, the loop, checkpoints, evaluation, export, metrics, summary."""
