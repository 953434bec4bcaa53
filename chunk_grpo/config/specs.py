"""The string specs of the configuration, parsed without torch: chunk sizes, G2RPO strides,
LoRA target presets and the export formats.

`chunk_grpo.config` checks these before any model loads (a command answers a bad flag before it
imports torch); `chunk_grpo.algorithm.chunking` and `chunk_grpo.algorithm.branching` build on the
same parsers.
"""

from __future__ import annotations


class ChunkSpecError(ValueError):
    """An invalid chunk specification; the message says what is allowed."""


class GranularityError(ValueError):
    """An invalid list of finishing granularities."""


def trained_transitions(num_steps: int, sde_window: int = 0) -> int:
    """W, the transitions with a trained log-prob: the SDE steps, never the last step into 0.

    sde_window 0: every step is stochastic (W = T - 1). sde_window k: the first k steps are
    stochastic and the rest deterministic ODE steps (W = min(k, T - 1)).
    """
    if sde_window < 0:
        raise ValueError(f"sde_window must be >= 0, got {sde_window}")
    return num_steps - 1 if sde_window == 0 else min(sde_window, num_steps - 1)


def chunk_sizes(spec: str, num_trained: int, chunk_size: int | None = None
                ) -> tuple[int, ...] | None:
    """The chunk sizes for ``num_trained`` transitions, or None for "auto" (needs the profile).

    spec: "2,3,4,7" (sizes summing to num_trained), "step", "sequence" or "auto".
    chunk_size: fixed-size chunks (the last one takes the remainder); overrides spec.
    """
    if num_trained < 1:
        raise ChunkSpecError(f"need at least one trained transition, got {num_trained}")
    if chunk_size is not None:
        if chunk_size < 1:
            raise ChunkSpecError(f"chunk_size must be >= 1, got {chunk_size}")
        full, rest = divmod(num_trained, chunk_size)
        return tuple([chunk_size] * full + ([rest] if rest else []))
    text = str(spec).strip().lower()
    if text == "auto":
        return None
    if text == "step":
        return (1,) * num_trained
    if text == "sequence":
        return (num_trained,)
    try:
        sizes = tuple(int(p) for p in text.replace(" ", "").split(","))
    except ValueError:
        raise ChunkSpecError(
            f"chunks must be 'auto', 'step', 'sequence' or comma-separated sizes like "
            f"'2,3,4,7', got {spec!r}") from None
    if any(s < 1 for s in sizes):
        raise ChunkSpecError(f"chunk sizes must be >= 1, got {spec!r}")
    if sum(sizes) != num_trained:
        raise ChunkSpecError(
            f"chunk sizes {spec!r} sum to {sum(sizes)} but there are {num_trained} trained "
            f"transitions (sampling.steps - 1, or sampling.sde_window); make them sum to "
            f"{num_trained}")
    return sizes


def parse_granularities(spec: str) -> tuple[int, ...]:
    """"1,2" -> (1, 2): distinct positive ODE strides for the finishes, the first one stored."""
    try:
        values = tuple(int(s) for s in str(spec).split(",") if s.strip())
    except ValueError:
        raise GranularityError(f"granularities must be comma-separated integers such as '1,2', "
                               f"got {spec!r}") from None
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise GranularityError(f"granularities must be distinct integers >= 1 such as '1,2', "
                               f"got {spec!r}")
    return values


# LoRA target presets, by module name inside FLUX's blocks (diffusers' FluxTransformer2DModel:
# `transformer_blocks` are the double-stream blocks, `single_transformer_blocks` the single ones).
_ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
_TEXT_ATTENTION = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
_REST_OF_BLOCKS = (
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",  # double: MLPs
    "norm1.linear", "norm1_context.linear",  # double: the AdaLN modulation linears
    "proj_mlp", "proj_out", "norm.linear",  # single: MLP in, fused output, AdaLN modulation
)
LORA_PRESETS = {
    "attention": _ATTENTION,  # the image stream's attention (and the single blocks' q, k, v)
    "attention+text": _ATTENTION + _TEXT_ATTENTION,  # both streams, as Flow-GRPO trains
    "all": _ATTENTION + _TEXT_ATTENTION + _REST_OF_BLOCKS,  # every linear layer of every block
}


def lora_target_modules(spec: str | list[str] | tuple[str, ...]) -> list[str]:
    """The module names a LoRA targets: a preset (`LORA_PRESETS`: attention, attention+text,
    all), given as a name or a one-element list; or a list of module names, kept as given (a
    name matches every module whose dotted name ends with it, as in PEFT)."""
    preset = preset_name(spec)
    if preset is not None:
        return list(LORA_PRESETS[preset])
    names = [spec] if isinstance(spec, str) else list(spec)
    presets = [n for n in names if n in LORA_PRESETS]
    if presets:
        raise ValueError(f"lora_targets: the preset {presets[0]!r} cannot be mixed with module "
                         f"names; give either one preset or a list of module names")
    if not names:
        raise ValueError(f"lora_targets is empty; give a preset ({', '.join(LORA_PRESETS)}) or "
                         "module names like to_q,to_k")
    return names


def preset_name(spec: str | list[str] | tuple[str, ...]) -> str | None:
    names = [spec] if isinstance(spec, str) else list(spec)
    return names[0] if len(names) == 1 and names[0] in LORA_PRESETS else None


# What a run writes at the end (`run.export`), in the order they are written and reported.
EXPORT_FORMATS = ("merged", "lora", "transformer")


def export_formats(spec: list[str] | tuple[str, ...], lora: bool) -> tuple[str, ...]:
    """The exports of a run: the formats named (`EXPORT_FORMATS`), where "auto" means merged,
    plus lora on a LoRA run. ``lora``: whether the run trains LoRA adapters."""
    names = set(spec)
    unknown = sorted(names - {"auto", *EXPORT_FORMATS})
    if unknown:
        raise ValueError(f"run.export: {unknown[0]!r} is not an export format; give one or more "
                         f"of auto, {', '.join(EXPORT_FORMATS)}")
    if not names:
        raise ValueError(f"run.export is empty; give one or more of auto, "
                         f"{', '.join(EXPORT_FORMATS)}")
    if "lora" in names and not lora:
        raise ValueError("run.export: lora needs LoRA adapters (model.lora_rank > 0) and this run "
                         "fine-tunes the whole transformer; export merged or transformer")
    if "auto" in names:
        names |= {"merged", "lora"} if lora else {"merged"}
    return tuple(f for f in EXPORT_FORMATS if f in names)
