"""Prompt sets: files, datasets and the shapes world's sets, checked before a run."""
