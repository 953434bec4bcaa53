"""On-policy the importance ratio is exactly 1 (fp32 and bf16 autocast, with activation
checkpointing; full fine-tuning and LoRA on an NF4 base), whatever the batch layout of rollout
and training calls."""


import pytest
import torch

from chunk_grpo.algorithm.chunking import ChunkLayout
from chunk_grpo.algorithm.policy_update import (
    LossSettings,
    UpdateRecord,
    accumulate_gradients,
    chunk_logprobs,
    plan_units,
)
from chunk_grpo.algorithm.rollout import RolloutSettings, sample_rollouts
from chunk_grpo.models import FluxPolicy
from chunk_grpo.models.policy_setup import prepare_transformer
from chunk_grpo.models.quantize import quantize_base
from chunk_grpo.train.optim import build_optimizer


@pytest.fixture(scope="module", params=["full", "lora-nf4"])
def policy(tiny_flux, request):
    """Full fine-tuning, or LoRA on an NF4 base (QLoRA, `chunk_grpo.models.quantize`): rollouts and
    updates compute with the same quantized weights."""
    policy = FluxPolicy.from_pretrained(tiny_flux)
    lora = request.param == "lora-nf4"
    if lora:
        pytest.importorskip("bitsandbytes")
        quantize_base(policy.transformer, "nf4", compute_dtype=torch.float32, device="cpu")
    prepare_transformer(policy.transformer, lora_rank=4 if lora else 0, lora_alpha=None,
                        lora_targets="attention+text" if lora else [], lora_seed=0,
                        gradient_checkpointing=True, attention_backend="auto")
    if lora:  # B = 0 would leave the adapters out of the computation: make them count
        with torch.no_grad():
            for name, param in policy.transformer.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return policy


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_ratio_is_exactly_one_when_the_policy_has_not_moved(policy, precision):
    rollout = sample_rollouts(policy, ["a red circle", "one green triangle"], RolloutSettings(
        group_size=3, num_steps=5, shift=3.0, kind="flow", eta=0.7, seed=0,
        batch_size=4, mixed_precision=precision))  # 4 != any train call
    layout = ChunkLayout((1, 3))
    steps = [layout.steps(0), layout.steps(1)]
    # A no-grad recomputation (the snapshot) equals the one training makes with autograd and
    # activation checkpointing, bit for bit.
    rows = torch.tensor([0, 2, 5])
    with torch.no_grad():
        snap = chunk_logprobs(policy, rollout, rollout.prompt_embeds, rows, steps[1], kind="flow",
                              eta=0.7, cfg_scale=1.0, mixed_precision=precision)
    live = chunk_logprobs(policy, rollout, rollout.prompt_embeds, rows, steps[1], kind="flow",
                          eta=0.7, cfg_scale=1.0, mixed_precision=precision)
    assert live.requires_grad and torch.equal(live.detach(), snap)

    # A whole update with an optimizer that cannot move the weights (lr 0): an optimizer step
    # after every unit and two epochs, so every unit but the first uses a snapshot. A clip range
    # of 1e-7 would expose any ratio that is not exactly 1.
    params = [p for p in policy.transformer.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = build_optimizer(params, name="adamw", lr=0.0, betas=(0.9, 0.999), eps=1e-8,
                          weight_decay=0.0)
    settings = LossSettings(kind="flow", eta=0.7, cfg_scale=1.0, clip_low=1e-7, clip_high=1e-7,
                            kl_coef=0.1, mixed_precision=precision, ppo_epochs=2, grad_accum=1)
    units = plan_units([0, 1], 6, 4, torch.Generator().manual_seed(1), split_chunks=True)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    result, boundaries = UpdateRecord(), 0
    for nonfinite in accumulate_gradients(policy, rollout, rollout.prompt_embeds, adv, units,
                                          steps, settings, result):
        assert not nonfinite
        opt.step()
        opt.zero_grad(set_to_none=True)
        boundaries += 1
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert boundaries == 2 * len(units)
    for stats in result.chunk_stats.values():
        assert stats["ratio_mean"] == [1.0] * len(stats["ratio_mean"])
        assert stats["clip_frac"] == [0.0] * len(stats["clip_frac"])
        assert stats["approx_kl"] == [0.0] * len(stats["approx_kl"])
    # The sampler's own log-probs are the same math: equal up to rounding of batch layouts.
    tol = 1e-4 if precision == "no" else 5e-2
    assert result.rollout_logp_gap < tol
