"""The trained model, written in the formats a run asks for (`run.export`, `EXPORT_FORMATS`):

- merged: ``final_model/``, a diffusers pipeline directory with any LoRA merged (what
  ``python -m chunk_grpo.evaluate --model.name`` and `FluxPipeline.from_pretrained` load);
- lora: ``final_lora/pytorch_lora_weights.safetensors``, the adapters in diffusers' format
  (``transformer.<module>.lora_A.weight`` / ``lora_B.weight``) with peft's LoraConfig (rank,
  alpha, targets) in the file's metadata, so `FluxPipeline.load_lora_weights` on the base
  reproduces the trained model whatever lora_alpha is;
- transformer: ``final_transformer/``, the merged `FluxTransformer2DModel` alone
  (``save_pretrained`` layout: config.json and safetensors, no text encoders or VAE).

The weights are written in the run's weights dtype (bf16 where the frozen weights are bf16).
Each directory is written under a temporary name and moved into place when complete. Under
FSDP / DDP the trained transformer is gathered once, onto rank 0's CPU (`export_full_model`), and
written there.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from chunk_grpo.config.specs import EXPORT_FORMATS, export_formats
from chunk_grpo.models.policy_setup import (
    export_pipeline,
    merged_transformer,
    publish_dir,
    uses_lora,
)
from chunk_grpo.models.quantize import quantization_of
from chunk_grpo.runtime.parallelize import unwrapped

EXPORT_DIRS = {"merged": "final_model", "lora": "final_lora", "transformer": "final_transformer"}
LORA_FILE = "pytorch_lora_weights.safetensors"  # the name load_lora_weights looks for


def export_targets(run_dir: str | Path, spec: list[str], lora: bool) -> dict[str, Path]:
    """{format: directory} of a run's exports (``spec`` as in `run.export`)."""
    return {fmt: Path(run_dir) / EXPORT_DIRS[fmt] for fmt in export_formats(spec, lora)}


def write_exports(pipeline, transformer: torch.nn.Module, targets: Mapping[str, Path], *,
                  defaults=None, dtype: torch.dtype | None = None,
                  copy_weights: bool = True) -> dict[str, Path]:
    """Write ``transformer`` (with its LoRA adapters, if any, unmerged) in each format of
    ``targets`` ({format: directory}); returns the directories written, in `EXPORT_FORMATS`
    order. ``pipeline`` supplies the rest of the merged model; ``defaults`` (SamplingDefaults)
    are saved with it. ``copy_weights`` False: ``transformer`` is a copy the caller drops, cast
    in place rather than copied again."""
    unknown = sorted(set(targets) - set(EXPORT_FORMATS))
    if unknown:
        raise ValueError(f"unknown export format {unknown[0]!r}; known: {EXPORT_FORMATS}")
    written = {}
    if "lora" in targets:
        written["lora"] = save_lora(type(pipeline), transformer, targets["lora"], dtype=dtype)
    if "merged" in targets or "transformer" in targets:
        plain = merged_transformer(transformer, copy_weights).eval()
        if dtype is not None and quantization_of(transformer) == "none":  # else bf16 already
            plain = plain.to(dtype)
        if "merged" in targets:
            written["merged"] = export_pipeline(pipeline, plain, targets["merged"],
                                                defaults=defaults, copy_weights=False)
        if "transformer" in targets:
            written["transformer"] = publish_dir(targets["transformer"], plain.save_pretrained)
    return {fmt: written[fmt] for fmt in EXPORT_FORMATS if fmt in written}


def save_lora(pipeline_class, transformer: torch.nn.Module, out_dir: str | Path, *,
              dtype: torch.dtype | None = None) -> Path:
    """``out_dir/pytorch_lora_weights.safetensors``: the transformer's (one) LoRA adapter in
    diffusers' format, written by the pipeline class's own ``save_lora_weights`` with the
    adapter's LoraConfig as metadata (diffusers' loader reads lora_alpha from it)."""
    if not uses_lora(transformer):
        raise ValueError("the lora export needs a transformer with LoRA adapters; this one is "
                         "fine-tuned in full (export merged or transformer)")
    from peft.utils import get_peft_model_state_dict

    (adapter, config), *others = transformer.peft_config.items()
    if others:
        raise ValueError(f"the lora export writes one adapter; the transformer has "
                         f"{len(others) + 1}: {sorted(transformer.peft_config)}")
    state = get_peft_model_state_dict(transformer, adapter_name=adapter)
    state = {name: value.detach().to("cpu", dtype or value.dtype).contiguous()
             for name, value in state.items()}

    def write(directory: Path) -> None:
        pipeline_class.save_lora_weights(directory, transformer_lora_layers=state,
                                         transformer_lora_adapter_metadata=config.to_dict(),
                                         weight_name=LORA_FILE)

    return publish_dir(out_dir, write)


def gather_full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of the model (frozen ones too) as full CPU tensors on rank 0, an empty dict
    on the other ranks; every rank calls this (under FSDP it all-gathers one tensor at a time)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def plain_transformer(model: torch.nn.Module, full_state: dict[str, torch.Tensor]):
    """An unsharded copy of the (FLUX) transformer holding ``full_state``, built on the meta
    device so no second set of weights is initialised; keeps its LoRA adapters (unmerged)."""
    live = unwrapped(model)
    with torch.device("meta"):
        plain = type(live).from_config(live.config)
        if uses_lora(live):
            for name, config in live.peft_config.items():
                plain.add_adapter(copy.deepcopy(config), adapter_name=name)
    plain.load_state_dict(full_state, assign=True)
    return plain


def export_full_model(pipeline, model: torch.nn.Module, targets: Mapping[str, Path] | str | Path,
                      *, defaults=None, dtype: torch.dtype = torch.bfloat16) -> dict[str, Path]:
    """The trained transformer gathered to rank 0's CPU and written there in each format of
    ``targets`` ({format: directory}; a single directory is the merged export), in ``dtype``
    (bf16 safetensors by default). Every rank calls this; rank 0 writes and gets the
    directories written. The GPU holds one full tensor at a time (gathered, then copied to the
    CPU); rank 0's CPU the whole trained state once (cast in place)."""
    if not isinstance(targets, Mapping):
        targets = {"merged": Path(targets)}
    full = gather_full_state(model)
    written = {}
    if not dist.is_initialized() or dist.get_rank() == 0:
        plain = plain_transformer(model, full)
        full.clear()  # the plain copy holds the tensors: casting it frees each fp32 one
        written = write_exports(pipeline, plain, targets, defaults=defaults, dtype=dtype,
                                copy_weights=False)
    if dist.is_initialized():
        dist.barrier()
    return written
