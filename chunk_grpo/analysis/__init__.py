"""Measurements around training: the chunk ablation, gradient SNR, the GPU check."""
