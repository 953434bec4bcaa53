"""The base model for hybrid evaluation, from the trained policy's own weights.

Hybrid inference samples the first k steps with the trained model and the rest with the base
(against reward hacking). A second full pipeline for the base would double the weights in memory
(24 GB more for FLUX.1-dev in bf16, 48 GB in fp32). Instead:
  - with LoRA, the base is the same `FluxPolicy` with its adapters disabled during each velocity
    call (`AdaptersDisabled`): no copy at all;
  - with full fine-tuning, the trained weights move, so the base keeps one frozen copy of the
    transformer, in ``weights_dtype`` (`FrozenTransformerBase`); the VAE, text encoders and
    prompt cache are the policy's. The copy is not offloaded. Under FSDP it is sharded as the
    policy is and filled from the policy's own shards (`sharded_load.sharded_frozen_copy`):
    never whole on one device.
Both have the interface `chunk_grpo.algorithm.rollout.generate` and `evaluate_policy` use (velocity,
encode_prompts, initial_noise, decode, the sampling settings): only `velocity` differs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from chunk_grpo.models.policy_setup import uses_lora
from chunk_grpo.models.sharded_load import sharded_frozen_copy


class _PolicyView:
    """Everything but `velocity` is the policy's (read live: sizes, guidance, prompt cache)."""

    def __init__(self, policy):
        self.policy = policy

    def __getattr__(self, name: str):
        return getattr(self.policy, name)


class AdaptersDisabled(_PolicyView):
    """The base of a LoRA policy: its velocity with the adapters switched off."""

    def velocity(self, *args, **kwargs) -> torch.Tensor:
        transformer = self.policy.transformer
        transformer.disable_adapters()
        try:
            return self.policy.velocity(*args, **kwargs)
        finally:
            transformer.enable_adapters()


class FrozenTransformerBase(_PolicyView):
    """The base of a fully fine-tuned policy: its velocity through a frozen transformer copy."""

    def __init__(self, policy, transformer: torch.nn.Module):
        super().__init__(policy)
        self.base_transformer = transformer

    def velocity(self, *args, **kwargs) -> torch.Tensor:
        return self.policy.velocity(*args, transformer=self.base_transformer, **kwargs)


def frozen_copy(transformer: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen copy of a (plain, not LoRA) diffusers transformer in ``dtype``, built without an
    intermediate copy in the source dtype: the peak is the original plus the copy."""
    with torch.device("meta"):
        copy = type(transformer).from_config(transformer.config)
    state = {name: value.detach().to(dtype=dtype, copy=True)
             for name, value in transformer.state_dict().items()}
    copy.load_state_dict(state, assign=True)
    left = [n for n, t in [*copy.named_parameters(), *copy.named_buffers()] if t.is_meta]
    if left:  # a buffer outside the state dict would be left unallocated
        raise RuntimeError(f"frozen_copy: {left[:3]} were not copied")
    return copy.requires_grad_(False).eval()


def hybrid_base(policy, weights_dtype: torch.dtype,
                shard: Callable[[torch.nn.Module], object] | None = None):
    """The base for ``policy`` (call it before training moves any weight): its LoRA-disabled
    view, or, under full fine-tuning, a view through a frozen copy in ``weights_dtype``.
    ``shard``: the policy's transformer is sharded (FSDP) and this shards a module the same
    way; the copy is then built shard by shard."""
    if uses_lora(policy.transformer):
        return AdaptersDisabled(policy)
    if shard is not None:
        return FrozenTransformerBase(policy, sharded_frozen_copy(policy.transformer,
                                                                 weights_dtype, shard))
    return FrozenTransformerBase(policy, frozen_copy(policy.transformer, weights_dtype))
