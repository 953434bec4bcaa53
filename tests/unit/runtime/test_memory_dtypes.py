"""weights_dtype: frozen parts load in bf16 while trained weights stay fp32, and a LoRA policy on a
bf16 base computes the velocity of the fp32 model within bf16's rounding."""

import pytest
import torch
from trainer_utils import save_tiny_flux

from chunk_grpo.models import FluxPolicy
from chunk_grpo.models.policy_setup import prepare_transformer
from chunk_grpo.runtime.weights_dtype import load_dtypes, resolve_weights_dtype

WORDS = "a one two red green blue circle square big".split()
PROMPTS = ["two red circles", "a big blue square"]
# bf16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.2%) in every weight and activation;
# over the tiny transformer's blocks the velocity's relative error was measured at 0.5%.
BF16_RELATIVE_TOLERANCE = 0.03


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_flux(tmp_path_factory.mktemp("tiny_flux"), WORDS)


def test_auto_is_bf16_on_cuda_only_and_full_fine_tuning_stays_fp32():
    assert resolve_weights_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_weights_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_weights_dtype("bf16", "cpu") == torch.bfloat16
    assert load_dtypes("bf16", "cpu", lora_rank=8) == (torch.bfloat16, torch.bfloat16)
    assert load_dtypes("bf16", "cpu", lora_rank=0) == (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="weights_dtype must be one of auto, fp32, bf16"):
        resolve_weights_dtype("fp16", "cpu")


def _lora_policy(model_dir, dtype):
    policy = FluxPolicy.from_pretrained(model_dir, dtype=dtype, frozen_dtype=dtype)
    params = prepare_transformer(policy.transformer, lora_rank=4, lora_alpha=None,
                                 lora_targets=["attention+text"], gradient_checkpointing=False,
                                 attention_backend="native")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # non-zero adapters (lora_B starts at zero), the same in both models
        for name, param in policy.transformer.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return policy, params


def test_bf16_base_with_fp32_adapters_matches_the_fp32_model(model_dir):
    reference, _ = _lora_policy(model_dir, torch.float32)
    policy, params = _lora_policy(model_dir, torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in params)  # master weights
    frozen = [p for p in policy.transformer.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    assert policy.vae.dtype == torch.bfloat16 and policy.dtype == torch.bfloat16
    assert policy.pipeline.text_encoder_2.dtype == torch.bfloat16

    x = reference.initial_noise(2, torch.Generator().manual_seed(0))
    assert policy.initial_noise(2, torch.Generator().manual_seed(0)).dtype == torch.float32
    with torch.no_grad():
        v_ref = reference.velocity(x, 0.7, reference.encode_prompts(PROMPTS), cfg_scale=2.0)
        v = policy.velocity(x, 0.7, policy.encode_prompts(PROMPTS), cfg_scale=2.0)
    assert v.dtype == torch.float32
    error = float((v - v_ref).norm() / v_ref.norm())
    assert 0 < error < BF16_RELATIVE_TOLERANCE, error

    # Gradients reach the fp32 adapters through the bf16 base, and are fp32.
    policy.velocity(x, 0.7, policy.encode_prompts(PROMPTS)).square().mean().backward()
    grads = [p.grad for p in params]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


def test_full_fine_tuning_keeps_the_transformer_fp32(model_dir):
    dtype, frozen = load_dtypes("bf16", "cpu", lora_rank=0)
    policy = FluxPolicy.from_pretrained(model_dir, dtype=dtype, frozen_dtype=frozen)
    params = prepare_transformer(policy.transformer, lora_rank=0, lora_alpha=None,
                                 lora_targets=["attention"], gradient_checkpointing=False,
                                 attention_backend="native")
    assert all(p.dtype == torch.float32 for p in params) and policy.dtype == torch.float32
    assert policy.vae.dtype == torch.bfloat16
    x = policy.initial_noise(1, torch.Generator().manual_seed(0))
    v = policy.velocity(x, 0.5, policy.encode_prompts(PROMPTS[:1]))  # bf16 embeds, fp32 model
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    images = policy.decode(x)  # through the bf16 VAE
    assert images.dtype == torch.float32 and images.shape == (1, 3, 32, 32)
