"""Prepare the transformer for training: LoRA (on a preset or named modules) or full
fine-tuning, activation checkpointing, the attention backend; and export the trained weights as a
plain diffusers directory."""

from __future__ import annotations

import copy
import importlib.util
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from chunk_grpo.config.specs import LORA_PRESETS, lora_target_modules, preset_name
from chunk_grpo.models.quantize import dequantized_transformer, quantization_of
from chunk_grpo.runtime.parallelize import local_rows
from chunk_grpo.runtime.weights_dtype import keep_trainable_fp32

_BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")


def attention_backend_name(requested: str) -> str:
    """"auto" -> "flash" when flash-attn is importable (CUDA machines), else "native"."""
    if requested == "auto":
        return "flash" if importlib.util.find_spec("flash_attn") is not None else "native"
    if requested == "flash" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError("attention_backend 'flash' needs flash-attn (pip install flash-attn, "
                         "CUDA only); use 'native' or 'auto'")
    return requested


def resolve_lora_targets(transformer: torch.nn.Module,
                         spec: str | list[str] | tuple[str, ...]) -> list[str]:
    """The full names of the modules LoRA wraps for ``spec`` (see `lora_target_modules`).

    A preset names modules inside the transformer blocks only (FLUX's top-level `proj_out` is
    not a single block's `proj_out`); a name that matches no module is an error naming the
    presets."""
    names = lora_target_modules(spec)
    modules = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    if preset_name(spec) is not None:
        block = {n: n.split(".", 2)[2] for n in modules
                 if n.split(".", 1)[0] in _BLOCK_LISTS and n.count(".") >= 2}
        targets = [n for n, inner in block.items() if inner in names]
    else:
        targets = [n for n in modules if any(n == t or n.endswith("." + t) for t in names)]
        unmatched = [t for t in names if not any(n == t or n.endswith("." + t) for n in modules)]
        if unmatched:
            raise ValueError(f"lora_targets: {unmatched[0]!r} is neither a preset "
                             f"({', '.join(LORA_PRESETS)}) nor the name of a linear layer of the "
                             f"transformer (e.g. to_q, to_k, to_v, to_out.0, add_q_proj); fix it")
    if not targets:
        raise ValueError(f"lora_targets {names} match no linear layer of the transformer; use a "
                         f"preset ({', '.join(LORA_PRESETS)}) or its module names")
    return targets


def prepare_transformer(transformer: torch.nn.Module, *, lora_rank: int,
                        lora_alpha: float | None, lora_targets: str | list[str],
                        gradient_checkpointing: bool, attention_backend: str,
                        lora_seed: int | None = None) -> list:
    """Configure in place; returns the trainable parameters (fp32 LoRA adapters on a base of
    any dtype, or the whole transformer).

    ``lora_seed``: initialise the adapters from it (`seed_lora_weights`), the same values at
    every world size and whether the model is sharded or not; None keeps peft's draw from the
    global generator. On the ``meta`` device nothing is initialised: the caller seeds the
    adapters once the weights exist (`chunk_grpo.models.sharded_load`)."""
    transformer.set_attention_backend(attention_backend_name(attention_backend))
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if lora_rank > 0:
        from peft import LoraConfig

        targets = resolve_lora_targets(transformer, lora_targets)
        transformer.requires_grad_(False)
        transformer.add_adapter(LoraConfig(
            r=lora_rank, lora_alpha=lora_alpha or lora_rank, target_modules=targets,
            init_lora_weights="gaussian"))
        keep_trainable_fp32(transformer)
        if lora_seed is not None and not any(p.is_meta for p in transformer.parameters()):
            seed_lora_weights(transformer, lora_seed)
    else:
        transformer.requires_grad_(True)
    transformer.train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"no trainable parameters: check lora_targets {lora_targets} against "
                         "the transformer's module names")
    return params


def lora_a_init(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """peft's "gaussian" init of a lora_A weight [rank, in] (normal, std 1 / rank), drawn from a
    generator seeded by ``seed`` and the parameter's name: independent of the order parameters
    are visited in, of the global generator and of how the weight is sharded."""
    generator = torch.Generator().manual_seed((seed << 32) + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) / shape[0]


def seed_lora_weights(transformer: torch.nn.Module, seed: int) -> None:
    """Initialise every LoRA adapter in place: A from `lora_a_init`, B zero (so the adapted
    model starts as the base). Under FSDP each rank writes only its rows of A."""
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if ".lora_A." in name:
                local, start = local_rows(param)
                full = lora_a_init(name, param.shape, seed)
                local.copy_(full[start:start + local.shape[0]])
            elif ".lora_B." in name:
                local_rows(param)[0].zero_()


def uses_lora(transformer: torch.nn.Module) -> bool:
    return bool(getattr(transformer, "_hf_peft_config_loaded", False))


def load_trainable_state_dict(transformer: torch.nn.Module, state: dict[str, torch.Tensor]):
    params = dict(transformer.named_parameters())
    missing = [n for n in state if n not in params]
    if missing:
        raise ValueError(f"checkpoint has parameters the model lacks, e.g. {missing[:3]}; was "
                         "it saved with another LoRA / model configuration?")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


def merged_transformer(transformer: torch.nn.Module, copy_weights: bool = True
                       ) -> torch.nn.Module:
    """A plain copy of the transformer with any LoRA merged into its weights (without LoRA and
    with ``copy_weights`` False: the transformer itself, for a caller that owns it). A quantized
    base (`chunk_grpo.models.quantize`) is dequantized layer by layer, the LoRA merged into it in
    fp32, and returned in bf16 (FLUX.1-dev's own format; the 4-bit codes carry no more
    precision)."""
    if quantization_of(transformer) != "none":
        return dequantized_transformer(transformer, torch.bfloat16)
    if not copy_weights and not uses_lora(transformer):
        return transformer
    model = copy.deepcopy(transformer)
    if not uses_lora(model):
        return model
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    state = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items()
             if "lora_" not in k}
    plain = type(transformer).from_config(transformer.config)
    plain.load_state_dict(state)
    return plain


def export_pipeline(pipeline, transformer: torch.nn.Module, out_dir: str | Path,
                    defaults=None, dtype: torch.dtype | None = None,
                    copy_weights: bool = True) -> Path:
    """Save ``pipeline`` with ``transformer`` (LoRA merged, then cast to ``dtype`` if given,
    e.g. bf16 for FLUX.1-dev's own format) as a diffusers directory. ``copy_weights`` False
    casts ``transformer`` itself (a gathered copy the caller drops): no second copy in memory.

    A quantized base (`chunk_grpo.models.quantize`) is dequantized, the LoRA merged into it in fp32,
    and saved in bf16 whatever ``dtype`` says (FLUX.1-dev's own format; the 4-bit codes carry
    no more precision than that).

    ``defaults`` (the model's SamplingDefaults) is saved with it, so evaluation samples the
    exported model exactly as the base. Written to a temporary directory, then moved into place.
    """
    plain = merged_transformer(transformer, copy_weights).eval()
    if dtype is not None and quantization_of(transformer) == "none":
        plain = plain.to(dtype)

    def write(tmp: Path) -> None:
        original = pipeline.transformer
        pipeline.transformer = plain
        try:
            pipeline.save_pretrained(tmp)
        finally:
            pipeline.transformer = original
        if defaults is not None:
            defaults.save(tmp)

    return publish_dir(out_dir, write)


def publish_dir(out_dir: str | Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` into a temporary sibling of ``out_dir``, then moved into its place: a
    kill leaves either the previous directory or the complete new one."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    write(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.replace(out_dir)
    return out_dir
