"""Evaluating a policy: sample a prompt set, score it, CIs and paired comparisons."""
