"""The memory plan's quantized base (`model.base_quantization`, `chunk_grpo.models.quantize`).

Bytes of the frozen base when the linear layers of the transformer's blocks are quantized by
bitsandbytes and everything else (the root: embedders, final norm and projection; the blocks'
norms; the quantized layers' biases) stays in ``weights_dtype``. Per quantized layer of
``n`` = out x in weights and ``out`` rows:

- nf4 (blocksize 64, double quantization): the codes, two per byte, n/2; one uint8 absmax per
  block of 64 values, ceil(n/64); one fp32 scale per 256 absmax, 4 ceil(n/64/256); and the
  constant quantization state: the 16-entry NF4 code and the 256-entry code of the absmax, fp32,
  and the absmax offset: 4 (16 + 256 + 1) = 1092 bytes. About 0.516 B/param (without double
  quantization it would be 0.5 + 4/64 = 0.5625).
- int8 (LLM.int8()): n int8 values and one fp32 scale per output row, n + 4 out: about 1 B/param.

A quantized layer computes with its weight dequantized to the compute dtype for the duration of
its matmul (forward; again in the backward for the input's gradient): one such weight at a time,
the largest of the blocks' linear layers (`dequantized_bytes`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from chunk_grpo.models.quantize import NESTED_BLOCKSIZE, NF4_BLOCKSIZE, block_linears
from chunk_grpo.plan.models import build_transformer, count_parameters, resolve_model_configs

NF4_STATE_BYTES = 4 * (16 + 256 + 1)  # fp32: NF4 code, the absmax code, the absmax offset


def nf4_layer_bytes(weights: int) -> int:
    """Bytes bitsandbytes holds for one NF4 layer of ``weights`` values (double-quantized)."""
    blocks = math.ceil(weights / NF4_BLOCKSIZE)
    return math.ceil(weights / 2) + blocks + 4 * math.ceil(blocks / NESTED_BLOCKSIZE) \
        + NF4_STATE_BYTES


def int8_layer_bytes(weights: int, rows: int) -> int:
    """Bytes bitsandbytes holds for one int8 layer: the int8 weights and a fp32 scale per row."""
    return weights + 4 * rows


@dataclass(frozen=True)
class QuantizedLayers:
    """The blocks' linear layers of a transformer: their shapes (out, in) and biases, and the
    parameters outside them (kept in ``weights_dtype``)."""

    shapes: tuple[tuple[int, int], ...]
    biases: int  # bias values of the quantized layers
    rest: int  # every other parameter of the transformer

    @property
    def weights(self) -> int:
        return sum(o * i for o, i in self.shapes)

    @property
    def largest(self) -> int:
        return max(o * i for o, i in self.shapes)


@functools.lru_cache(maxsize=8)
def quantized_layers(model: str) -> QuantizedLayers:
    """The layers `quantize_base` quantizes in ``model``'s transformer (built on meta)."""
    transformer = build_transformer(resolve_model_configs(model).transformer)
    layers = [child for _, _, child in block_linears(transformer)]
    shapes = tuple((layer.out_features, layer.in_features) for layer in layers)
    biases = sum(layer.bias.numel() for layer in layers if layer.bias is not None)
    weights = sum(o * i for o, i in shapes)
    return QuantizedLayers(shapes, biases, count_parameters(transformer) - weights - biases)


def quantized_base_bytes(layers: QuantizedLayers, kind: str, weights_bytes: int) -> float:
    """Bytes of the frozen base with the blocks' linear layers in ``kind`` and the rest (and
    the biases) at ``weights_bytes`` per parameter."""
    if kind == "nf4":
        quantized = sum(nf4_layer_bytes(o * i) for o, i in layers.shapes)
    elif kind == "int8":
        quantized = sum(int8_layer_bytes(o * i, o) for o, i in layers.shapes)
    else:
        raise ValueError(f"no quantized base for base_quantization {kind!r}")
    return quantized + weights_bytes * (layers.biases + layers.rest)


def dequantized_bytes(layers: QuantizedLayers, compute_bytes: int) -> float:
    """The largest quantized layer's weight in the compute dtype: the working set of one
    dequantization."""
    return compute_bytes * layers.largest
