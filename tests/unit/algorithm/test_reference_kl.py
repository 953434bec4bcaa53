"""The KL reference (`loss.kl_ref: reference`) is the trainer's base view (`hybrid_base`):
under LoRA the adapters disabled, under full fine-tuning a frozen copy of the initial
transformer. Its log-probs are the base model's exactly, and the KL term starts at 0."""

import pytest
import torch
from trainer_utils import tiny_config

from chunk_grpo.algorithm.policy_update import (
    LossSettings,
    UpdateRecord,
    accumulate_gradients,
    chunk_logprobs,
    plan_units,
)
from chunk_grpo.algorithm.rollout import sample_rollouts
from chunk_grpo.models import FluxPolicy
from chunk_grpo.models.hybrid_base import AdaptersDisabled, FrozenTransformerBase
from chunk_grpo.runtime import distributed as D
from chunk_grpo.train.loop import train_iteration
from chunk_grpo.train.setup import build_trainer, rollout_settings

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")

STEPS = [0, 1, 2, 3]


def _logprobs(model, rollout) -> torch.Tensor:
    with torch.no_grad():
        return chunk_logprobs(model, rollout, rollout.prompt_embeds,
                              torch.arange(rollout.latents.shape[0]), STEPS, kind="flow",
                              eta=0.7, cfg_scale=1.0)


def _trainer(model, tmp_path, overrides: dict):
    cfg = tiny_config(model, tmp_path / "run", {"loss.kl_ref": "reference", "loss.kl_coef": 0.1,
                                                "optim.lr": 3e-3,
                                                **overrides})
    return model, build_trainer(cfg, tmp_path / "run", D.init_distributed("cpu"))


def _rollout(tr):
    return sample_rollouts(tr.policy, ["a red circle", "two blue squares"],
                           rollout_settings(tr.cfg, tr.policy), step=99)


def test_lora_reference_is_the_adapter_disabled_model(tiny_flux, tmp_path):
    _, tr = _trainer(tiny_flux, tmp_path, overrides={"model.lora_rank": 4})
    assert isinstance(tr.reference, AdaptersDisabled) and tr.base_policy is None
    with torch.no_grad():  # adapters that move the velocity, as after training
        for name, p in tr.policy.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    rollout = _rollout(tr)
    reference = _logprobs(tr.reference, rollout)
    tr.policy.transformer.disable_adapters()
    try:
        disabled = _logprobs(tr.policy, rollout)
    finally:
        tr.policy.transformer.enable_adapters()
    assert torch.equal(reference, disabled)
    assert not torch.allclose(reference, _logprobs(tr.policy, rollout), atol=1e-4)


def test_full_fine_tuning_reference_is_the_untouched_base(tiny_flux, tmp_path):
    model, tr = _trainer(tiny_flux, tmp_path, overrides={"model.lora_rank": 0})
    assert isinstance(tr.reference, FrozenTransformerBase) and tr.base_policy is None
    base = FluxPolicy.from_pretrained(model)  # never trained
    rollout = _rollout(tr)
    assert torch.equal(_logprobs(tr.reference, rollout), _logprobs(base, rollout))
    first = train_iteration(tr, 0)[0]
    assert first["ref_kl"] == 0.0  # iteration 1: the policy is still the base, bit for bit
    later = [train_iteration(tr, step)[0]["ref_kl"] for step in (1, 2)]
    assert all(kl > 0 for kl in later)
    # the reference has not moved with the policy
    assert torch.equal(_logprobs(tr.reference, rollout), _logprobs(base, rollout))
    assert not torch.equal(_logprobs(tr.policy, rollout), _logprobs(base, rollout))


def test_reference_kl_without_a_reference_names_the_fix(tiny_flux, tmp_path):
    _, tr = _trainer(tiny_flux, tmp_path, overrides={"model.lora_rank": 0})
    rollout = _rollout(tr)
    settings = LossSettings(kind="flow", eta=0.7, cfg_scale=1.0, clip_low=0.2, clip_high=0.2,
                            kl_coef=0.1, kl_ref="reference")
    units = plan_units([0], rollout.latents.shape[0], 8)
    with pytest.raises(ValueError, match="needs the reference model"):
        next(accumulate_gradients(tr.policy, rollout, rollout.prompt_embeds,
                                  torch.zeros(rollout.latents.shape[0]), units, [[0, 1]],
                                  settings, UpdateRecord()))
