"""Chunk-GRPO for flow-matching text-to-image models.

When a command starts (``python -m chunk_grpo.train`` and the others), its flags are checked here,
before the command's module imports torch: ``--help`` and a bad flag answer at once.
"""

from chunk_grpo.cli_args import check_command_line_early

check_command_line_early()
