"""FLUX models: one loader for the shipped tiny model and FLUX.1-dev, and the policy wrapper."""

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
