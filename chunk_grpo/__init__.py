"""Chunk-GRPO for flow-matching text-to-image models.

``chunk-grpo <command>`` (or ``python -m chunk_grpo.<command>``) runs a command; ``chunk-grpo
--help`` lists them. The subpackages, from the lowest layer up (a module imports its own subpackage
and lower layers only): config; runtime, shapes, data; algorithm, models, rewards; plan, evaluate;
train; analysis, pretrain; cli.
"""
