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
Each directory is written under a temporary name and moved into place when complete.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from chunk_grpo.config.specs import EXPORT_FORMATS, export_formats
from chunk_grpo.models.policy_setup import (
    export_pipeline,
    merged_transformer,
    publish_dir,
    uses_lora,
)
from chunk_grpo.models.quantize import quantization_of

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
