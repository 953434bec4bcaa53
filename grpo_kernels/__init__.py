"""Fused GRPO kernels for flow-matching policies."""
