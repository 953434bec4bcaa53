"""FLUX models: one loader for the shipped tiny model and FLUX.1-dev, the policy wrapper, and what
readies it for training (LoRA and the attention backend, a quantized or sharded base, the
hybrid-evaluation base, the prompt-embedding cache).
"""

from chunk_grpo.models.loading import FLUX_DEV_ID, ModelLoadError, load_flux_pipeline
from chunk_grpo.models.policy import EMBEDDED_MODEL, FluxPolicy, PromptEmbeds
from chunk_grpo.models.sampling_defaults import SamplingDefaults

__all__ = [
    "EMBEDDED_MODEL",
    "FLUX_DEV_ID",
    "FluxPolicy",
    "ModelLoadError",
    "PromptEmbeds",
    "SamplingDefaults",
    "load_flux_pipeline",
]
