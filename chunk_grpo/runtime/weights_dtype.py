"""`weights_dtype`: the dtype of the weights nothing trains.

FLUX.1-dev in fp32 is 48 GB of transformer, 19 GB of T5-XXL and 0.3 GB of VAE and CLIP; in bf16
half that. Only trained weights need fp32 (the optimizer's master copy): the LoRA adapters, or the
whole transformer under full fine-tuning (where FSDP's mixed-precision policy computes in bf16).
Everything else -- VAE, text encoders, and the transformer's frozen base under LoRA -- loads in
``weights_dtype``: "auto" is bf16 on CUDA and fp32 elsewhere (a CPU without native bf16 runs it
many times slower, see `chunk_grpo.runtime.precision`).
"""

from __future__ import annotations

import torch

WEIGHTS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_weights_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """"auto" -> bf16 on CUDA, fp32 elsewhere; "fp32" / "bf16" as named."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype must be one of auto, {', '.join(WEIGHTS_DTYPES)}; "
                         f"got {name!r}")
    return WEIGHTS_DTYPES[name]


def load_dtypes(weights_dtype: str, device: torch.device | str,
                lora_rank: int) -> tuple[torch.dtype, torch.dtype]:
    """(transformer dtype, frozen parts' dtype) to load a policy in: the transformer in
    ``weights_dtype`` only under LoRA (its base is frozen), fp32 when it is trained in full."""
    frozen = resolve_weights_dtype(weights_dtype, device)
    return (frozen if lora_rank > 0 else torch.float32), frozen


def keep_trainable_fp32(module: torch.nn.Module) -> None:
    """Make every trainable parameter fp32 (PEFT creates adapters in their base layer's dtype):
    the optimizer updates fp32 master weights, so tiny lr x grad steps are not rounded away."""
    for param in module.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
