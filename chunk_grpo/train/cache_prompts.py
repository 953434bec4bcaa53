"""Fill the prompt cache once, before a run:

    python -m chunk_grpo.cache_prompts --config YAML [--section.key VALUE ...]

takes the flags of ``chunk_grpo.train`` and loads only the run's text encoders and tokenizers (no
transformer, no VAE), in the dtype the run loads them in, then writes the embeddings of both
prompt sets and the unconditional prompt to ``model.prompt_cache_dir`` under the key the run
computes (`chunk_grpo.models.prompt_cache`). A run with ``text_encoders: cache`` then finds every
prompt cached and never moves its text encoders to the GPU. Under torchrun the ranks of each node
split the prompts. Prints a progress bar and how many prompts were encoded and already cached.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import FluxPipeline

from chunk_grpo.config.schema import TrainConfig
from chunk_grpo.data.prompts import reads_lowercase_only
from chunk_grpo.models.loading import load_flux_pipeline
from chunk_grpo.models.policy import PromptEmbeds, encode_text
from chunk_grpo.models.prompt_cache import CacheFill, fill_prompt_cache, node_share, run_prompts
from chunk_grpo.models.sampling_defaults import SamplingDefaults
from chunk_grpo.runtime import distributed as D
from chunk_grpo.runtime.weights_dtype import load_dtypes
from chunk_grpo.train.setup import model_path, read_prompt_sets


@dataclass
class TextEncoders:
    """The text half of a FLUX pipeline: what the prompt cache needs of a policy."""

    pipeline: FluxPipeline
    defaults: SamplingDefaults
    lowercase_t5: bool

    @property
    def max_sequence_length(self) -> int:
        return self.defaults.max_sequence_length

    @property
    def has_text_encoders(self) -> bool:
        return True

    def encode_with_text_encoders(self, prompts: list[str]) -> PromptEmbeds:
        return encode_text(self.pipeline, prompts, self.max_sequence_length, self.lowercase_t5)


def load_text_encoders(cfg: TrainConfig, device: torch.device) -> TextEncoders:
    """The run's text encoders and tokenizers on the CPU, in the frozen parts' dtype the
    trainer loads them in on ``device`` (so the cache key is the run's)."""
    _, frozen_dtype = load_dtypes(cfg.model.weights_dtype, device, cfg.model.lora_rank)
    source = model_path(cfg.model.name)
    pipeline = load_flux_pipeline(source, dtype=frozen_dtype, device="cpu",
                                  skip=("transformer", "vae"))
    local = Path(os.fspath(source)).expanduser()
    defaults = SamplingDefaults.load(local) if local.is_dir() else SamplingDefaults()
    return TextEncoders(pipeline, defaults, reads_lowercase_only(pipeline.tokenizer_2))


def cache_prompts(cfg: TrainConfig, info: D.DistInfo) -> CacheFill:
    """Encode every prompt of ``cfg``'s run the cache lacks (this rank's share) and check that
    the cache then holds them all."""
    prompt_sets = read_prompt_sets(cfg)
    encoders = load_text_encoders(cfg, info.device)
    prompts = run_prompts(encoders, [p for _, s in prompt_sets.items() for p in s.prompts])
    if info.is_main:
        counts = ", ".join(f"{key} {len(s.prompts)}" for key, s in prompt_sets.items())
        print(f"[chunk-grpo] caching the embeddings of {len(dict.fromkeys(prompts))} distinct "
              f"prompts ({counts}, and the unconditional prompt); "
              f"{node_share(info)[1]} rank(s) per node encode", flush=True)
    barrier = lambda: D.barrier(info)  # noqa: E731
    return fill_prompt_cache(encoders, prompts, cfg.model.prompt_cache_dir,
                             share=node_share(info), agree=barrier, wait=barrier,
                             encode_device=info.device, progress=cfg.run.progress and info.is_main)
