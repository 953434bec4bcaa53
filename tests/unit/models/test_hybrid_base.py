"""The hybrid-evaluation base from the policy's own weights: LoRA disabled, or one frozen copy
under full fine-tuning. Its images equal those of a separately loaded base model."""

import pytest
import torch
from trainer_utils import save_tiny_flux

from chunk_grpo.algorithm.rollout import generate
from chunk_grpo.models import FluxPolicy
from chunk_grpo.models.hybrid_base import AdaptersDisabled, FrozenTransformerBase, hybrid_base
from chunk_grpo.models.policy_setup import prepare_transformer

WORDS = "a one two red green blue circle circles square big".split()
PROMPTS = ["two red circles", "a big blue square"]
STEPS, HYBRID = 4, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_flux(tmp_path_factory.mktemp("tiny_flux"), WORDS)


@pytest.fixture(scope="module")
def loaded_base(model_dir):
    return FluxPolicy.from_pretrained(model_dir)


def _images(policy, base=None, steps=HYBRID):
    return generate(policy, PROMPTS, num_steps=STEPS, seed=0,
                    hybrid_base=base, hybrid_steps=steps if base is not None else 0)


def _trained(model_dir, lora_rank):
    policy = FluxPolicy.from_pretrained(model_dir)
    prepare_transformer(policy.transformer, lora_rank=lora_rank, lora_alpha=None,
                        lora_targets=["attention+text"], gradient_checkpointing=False,
                        attention_backend="native")
    return policy


def _move(policy, which: str):
    """Change the trained weights as training would (big enough to change the images)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in policy.transformer.named_parameters():
            if param.requires_grad and which in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)


def test_lora_base_is_the_policy_with_adapters_disabled(model_dir, loaded_base):
    policy = _trained(model_dir, lora_rank=4)
    base = hybrid_base(policy, torch.float32)
    assert isinstance(base, AdaptersDisabled) and base.transformer is policy.transformer
    reference = _images(policy, loaded_base)
    # Fresh adapters (lora_B = 0): the policy is the base, and so is the view.
    torch.testing.assert_close(_images(policy, base), reference, rtol=0, atol=1e-6)

    _move(policy, "lora_")
    hybrid = _images(policy, base)
    torch.testing.assert_close(hybrid, _images(policy, loaded_base), rtol=0, atol=1e-6)
    assert (hybrid - reference).abs().max() > 1e-3  # the trained steps did change
    assert (hybrid - _images(policy)).abs().max() > 1e-3  # the base steps are the base's
    torch.testing.assert_close(_images(base), _images(loaded_base), rtol=0, atol=1e-6)
    # The adapters are back on after the base's calls, still trainable.
    assert (_images(policy) - _images(loaded_base)).abs().max() > 1e-3
    assert all(p.requires_grad for n, p in policy.transformer.named_parameters() if "lora_" in n)


def test_full_fine_tuning_base_is_one_frozen_copy(model_dir, loaded_base):
    policy = _trained(model_dir, lora_rank=0)
    base = hybrid_base(policy, torch.float32)
    assert isinstance(base, FrozenTransformerBase)
    assert base.base_transformer is not policy.transformer
    assert not any(p.requires_grad for p in base.base_transformer.parameters())
    _move(policy, "")
    hybrid = _images(policy, base)
    torch.testing.assert_close(hybrid, _images(policy, loaded_base), rtol=0, atol=1e-6)
    assert (hybrid - _images(policy)).abs().max() > 1e-3
    assert base.pipeline is policy.pipeline  # VAE, text encoders, prompt cache shared

    bf16 = hybrid_base(_trained(model_dir, lora_rank=0), torch.bfloat16)
    assert {p.dtype for p in bf16.base_transformer.parameters()} == {torch.bfloat16}
    assert torch.isfinite(_images(policy, bf16)).all()
