"""Chunk-GRPO trainer for flow-matching text-to-image models."""
