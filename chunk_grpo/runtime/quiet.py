"""Third-party chatter hidden from the commands' output, unless ``--verbose``.

Every command calls `quiet_third_party` as it starts, before its own imports
(`chunk_grpo.cli.main.run`), because some packages speak while they are being imported. Importing
``chunk_grpo`` as a library changes nothing: the calling program's logging and warnings are its own.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# Python warnings, by message (regular expressions)
_NOISE = (
    # bf16 activations meeting fp32 RMSNorm weights under autocast (torch's own fallback)
    r"Mismatch dtype between input and weight",
    r".*torch\.jit\.script_method.* is deprecated",
    r".*Attention backends are an experimental feature",
)


class _DropMessage(logging.Filter):
    """Drops one logger's records whose message starts with ``prefix``; the rest pass."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


# Log records that a package emits as it is imported, with no setting of its own to stop them:
# (logger, filter). Module-level filters, so that adding one twice is a no-op.
_NOISY_RECORDS = (
    # bitsandbytes 0.50 on CPUs with AVX512-BF16, at import (peft, transformers and diffusers
    # import it when installed): the optional `kernels` package, which would fetch a 4-bit GEMM
    # from the Hugging Face Hub, is missing. Neither this project nor its 8-bit AdamW uses it.
    ("bitsandbytes.backends.cpu.ops",
     _DropMessage("Failed to load CPU gemm_4bit_forward from kernels-community")),
)


def quiet_third_party(verbose: bool = False) -> None:
    """Hide third-party warnings and progress bars (transformers, diffusers, huggingface_hub,
    torch's dtype fallback notes, bitsandbytes' missing-`kernels` line), unless ``verbose``.
    Environment variables set by the user win; libraries imported later read them, libraries
    already imported are told directly."""
    if verbose:
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for pattern in _NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    for name, record_filter in _NOISY_RECORDS:
        # getLogger creates the logger the package will fetch by the same name when imported
        logging.getLogger(name).addFilter(record_filter)
    for name in ("transformers", "diffusers"):
        logging.getLogger(name).setLevel(logging.ERROR)
        module = sys.modules.get(f"{name}.utils.logging")
        if module is not None:
            module.set_verbosity_error()
            module.disable_progress_bar()
