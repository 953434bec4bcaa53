"""`model.base_quantization`: LoRA's frozen base stored in 4 bits (NF4) or 8 bits (int8), QLoRA.

Every ``nn.Linear`` inside the transformer's blocks (double- and single-stream: all but ~0.1 B
of FLUX.1-dev's 11.9 B parameters) is replaced by bitsandbytes' layer before the LoRA adapters
are attached (`quantize_base`), so peft wraps the quantized layer (its bitsandbytes LoRA
classes) and the adapters stay fp32. The embedders and the final norm/projection (the "root")
stay in ``weights_dtype``. The hybrid-evaluation base and the KL reference are the same
quantized weights with the adapters disabled; rollouts and updates call the same layers, and
bitsandbytes computes a layer's forward with one kernel whether or not autograd records it, so
the on-policy ratio is exactly 1.

- ``nf4``: `bnb.nn.Linear4bit`, NF4 codes packed two per byte in uint8 storage, one absmax per
  block of 64 values, double-quantized (the absmax in 8 bits, one fp32 scale per 256 of them);
  the forward dequantizes one weight at a time to the compute dtype.
- ``int8``: `bnb.nn.Linear8bitLt` (LLM.int8(): int8 weights with one fp32 scale per output row,
  outlier columns above 6.0 computed in 16 bits).

Where it runs: bitsandbytes quantizes a weight when it moves to a device (``.to(device)``).
The transformer loads on the CPU in ``weights_dtype`` and each layer is quantized as it moves
to the run's device, layer by layer: on CUDA only the quantized weights reach the GPU; on the
CPU bitsandbytes' CPU kernels quantize and compute (both kinds). diffusers' own
``BitsAndBytesConfig`` loading needs a GPU, hence the layer-level replacement here.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

BASE_QUANTIZATIONS = ("none", "nf4", "int8")
NF4_BLOCKSIZE = 64  # values per absmax (bitsandbytes' Linear4bit default)
NESTED_BLOCKSIZE = 256  # absmax values per fp32 scale of the double quantization
INT8_THRESHOLD = 6.0  # LLM.int8()'s outlier threshold
_BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")
# peft reads these to dispatch its bitsandbytes LoRA layers (`peft.tuners.lora.bnb`)
_PEFT_FLAGS = {"nf4": "is_loaded_in_4bit", "int8": "is_loaded_in_8bit"}


def bitsandbytes_available() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def _bnb():
    import bitsandbytes as bnb

    return bnb


def quantized_linear_class(kind: str) -> type:
    """bitsandbytes' layer class of ``kind`` ("nf4" | "int8")."""
    bnb = _bnb()
    return {"nf4": bnb.nn.Linear4bit, "int8": bnb.nn.Linear8bitLt}[kind]


def is_quantized_linear(module: nn.Module) -> bool:
    if not bitsandbytes_available() or "bitsandbytes" not in str(type(module).__module__):
        return False
    bnb = _bnb()
    return isinstance(module, bnb.nn.Linear4bit | bnb.nn.Linear8bitLt)


def quantize_linear(linear: nn.Linear, kind: str, compute_dtype: torch.dtype,
                    device: torch.device | str) -> nn.Module:
    """A frozen bitsandbytes copy of ``linear`` on ``device`` (quantized as it moves there);
    ``linear``'s own weight is not kept."""
    bnb = _bnb()
    bias = linear.bias is not None
    weight = linear.weight.detach()
    if kind == "nf4":
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias,
                                  compute_dtype=compute_dtype, compress_statistics=True,
                                  quant_type="nf4", quant_storage=torch.uint8, device="meta")
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4",
                                         blocksize=NF4_BLOCKSIZE, compress_statistics=True,
                                         quant_storage=torch.uint8)
        # bitsandbytes repacks a weight for its AVX512-BF16 CPU kernel on the first no-grad call
        # in eval mode: another kernel than the training call's, so the ratio would move off 1
        layer.support_avx512bf16_for_cpu = False
    elif kind == "int8":
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias,
                                    has_fp16_weights=False, threshold=INT8_THRESHOLD,
                                    device="meta")
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        raise ValueError(f"base_quantization must be one of {', '.join(BASE_QUANTIZATIONS)}; "
                         f"got {kind!r}")
    if bias:
        layer.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    return layer.to(device)


def block_linears(transformer: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) of every plain ``nn.Linear`` inside the transformer's blocks."""
    found = []
    for list_name in _BLOCK_LISTS:
        for block in getattr(transformer, list_name, ()):
            for parent in block.modules():
                found.extend((parent, name, child) for name, child in parent.named_children()
                             if type(child) is nn.Linear)
    return found


def quantize_base(transformer: nn.Module, kind: str, *, compute_dtype: torch.dtype,
                  device: torch.device | str) -> int:
    """Replace every linear layer of the blocks by its ``kind`` quantization on ``device``, one
    layer at a time (each layer's source weight is freed once it is replaced), then move the
    rest of the transformer there. Call before the LoRA adapters are attached. Returns the
    number of layers quantized."""
    if kind not in _PEFT_FLAGS:
        raise ValueError(f"base_quantization must be nf4 or int8 to quantize, got {kind!r}")
    layers = block_linears(transformer)
    transformer.requires_grad_(False)
    for parent, name, linear in layers:
        setattr(parent, name, quantize_linear(linear, kind, compute_dtype, device))
        del linear
    nn.Module.to(transformer, device)  # the root and the norms (diffusers' `to` would warn)
    if torch.device(device).type == "cpu":
        # The weights kept as loaded are views of the checkpoint's memory map, which would keep
        # every page of the file read while quantizing resident: give them their own memory.
        with torch.no_grad():
            for tensor in [*transformer.parameters(), *transformer.buffers()]:
                if tensor.dtype.is_floating_point:
                    tensor.data = tensor.data.clone()
    setattr(transformer, _PEFT_FLAGS[kind], True)
    return len(layers)


def dequantized_weight(layer: nn.Module) -> torch.Tensor:
    """The weight of a bitsandbytes layer, dequantized to fp32 [out, in]."""
    bnb = _bnb()
    if isinstance(layer, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    scales = layer.weight.SCB if layer.weight.SCB is not None else layer.state.SCB
    return layer.weight.data.float() * (scales.float().unsqueeze(1) / 127.0)


def merged_plain_state(transformer: nn.Module, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The state dict of the plain transformer ``transformer`` stands for: each quantized layer
    dequantized, each LoRA adapter merged into its (dequantized) base weight in fp32, peft's
    ``base_layer`` names undone; each tensor then cast to ``dtype`` on ``device`` as it is made
    (one fp32 weight at a time on the transformer's device)."""
    from peft.tuners.lora import LoraLayer

    state: dict[str, torch.Tensor] = {}
    handled: set[str] = set()
    for name, module in transformer.named_modules():
        prefix = name + "." if name else ""
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            weight = (dequantized_weight(base) if is_quantized_linear(base)
                      else base.weight.detach().float())
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = weight + module.get_delta_weight(adapter).float()
            state[prefix + "weight"] = weight.to(device=device, dtype=dtype)
            del weight
        elif is_quantized_linear(module) and not any(prefix.startswith(h) for h in handled):
            state[prefix + "weight"] = dequantized_weight(module).to(device=device, dtype=dtype)
            base = module
        else:
            continue
        if base.bias is not None:
            state[prefix + "bias"] = base.bias.detach().to(device=device, dtype=dtype)
        handled.add(prefix)
    for key, value in transformer.state_dict().items():
        plain = key.replace(".base_layer", "")
        if "lora_" in key or any(plain.startswith(h) for h in handled):
            continue
        state[plain] = value.detach().to(device=device, dtype=dtype if value.is_floating_point()
                                          else value.dtype)
    return state


def dequantized_transformer(transformer: nn.Module, dtype: torch.dtype = torch.bfloat16
                            ) -> nn.Module:
    """A plain diffusers transformer on the CPU in ``dtype``: the quantized base dequantized
    with the LoRA merged into it (`merged_plain_state`), built without a second copy."""
    with torch.device("meta"):
        plain = type(transformer).from_config(transformer.config)
    plain.load_state_dict(merged_plain_state(transformer, dtype, "cpu"), assign=True)
    left = [n for n, t in [*plain.named_parameters(), *plain.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"dequantized_transformer: {left[:3]} were not filled")
    return plain.requires_grad_(False).eval()


def quantization_of(transformer: nn.Module) -> str:
    """"nf4", "int8" or "none": how `quantize_base` left ``transformer``."""
    for kind, flag in _PEFT_FLAGS.items():
        if getattr(transformer, flag, False):
            return kind
    return "none"
