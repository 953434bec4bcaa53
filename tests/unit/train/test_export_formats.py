"""The export formats of a run (`run.export`): a LoRA run of the embedded default exports a
diffusers LoRA file that `FluxPipeline.load_lora_weights` puts on the base model, which then
samples the merged model's images from the same noise (whatever lora_alpha is, EMA or not);
the transformer-only export is the merged model's transformer."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import FluxTransformer2DModel
from safetensors import safe_open

from chunk_grpo.cli.train import main
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config
from chunk_grpo.config.specs import export_formats
from chunk_grpo.evaluate.evaluation import evaluate_policy
from chunk_grpo.models import EMBEDDED_MODEL, FluxPolicy
from chunk_grpo.train.export import export_targets

PROMPTS = ["a large green triangle on the left", "two small red circles above a large blue square"]


def test_export_formats_resolve_auto_and_refuse_lora_without_adapters(tmp_path):
    assert export_formats(["auto"], lora=True) == ("merged", "lora")
    assert export_formats(["auto"], lora=False) == ("merged",)
    assert export_formats(["transformer", "lora", "lora"], lora=True) == ("lora", "transformer")
    assert export_formats(["auto", "transformer"], lora=False) == ("merged", "transformer")
    assert export_targets(tmp_path, ["lora"], True) == {"lora": tmp_path / "final_lora"}
    assert build_config(None, {"run.export": "lora,transformer", "model.lora_rank": 4}
                        ).run.export == ["lora", "transformer"]
    for export, rank, message in (
            ("lora", 0, r"^run.export: lora needs LoRA adapters \(model.lora_rank > 0\) and "
                        r"this run fine-tunes the whole transformer; export merged or "
                        r"transformer$"),
            ("merged,safetensors", 8, r"^run.export: 'safetensors' is not an export format; "
                                      r"give one or more of auto, merged, lora, transformer$"),
            ("", 8, r"^run.export is empty")):
        with pytest.raises(ConfigError, match=message):
            build_config(None, {"run.export": export, "model.lora_rank": rank})


def velocities(policy: FluxPolicy) -> torch.Tensor:
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        return policy.velocity(x, torch.tensor([0.8, 0.35]), policy.encode_prompts(PROMPTS))


def sampled_images(policy: FluxPolicy) -> torch.Tensor:
    """Images of the project's ODE sampler, the same noise for every policy (seed 3)."""
    return evaluate_policy(policy, PROMPTS, reward="shapes", seed=3).images


@pytest.mark.slow  # a LoRA training run of the embedded default per case, ~25 s each
@pytest.mark.parametrize("lora_alpha, ema_decay", [(None, 0.0), (24.0, 0.5)],
                         ids=["alpha=rank", "alpha!=rank,ema"])
def test_lora_export_loads_in_diffusers_and_samples_the_merged_models_images(
        tmp_path, lora_alpha, ema_decay):
    out = tmp_path / "run"
    main(["--run.max_steps", "1", "--run.output_dir", str(out), "--run.progress", "false",
          "--run.export", "auto,transformer", "--model.lora_rank", "8",
          *(["--model.lora_alpha", str(lora_alpha)] if lora_alpha else []),
          "--optim.ema_decay", str(ema_decay), "--optim.lr", "3e-2",
          "--sampling.prompts_per_step", "2", "--sampling.group_size", "2",
          "--chunks.profile_prompts", "2", "--eval.images", "2", "--eval.final_images", "2",
          "--eval.hybrid_steps", "0"])
    lora_file = out / "final_lora" / "pytorch_lora_weights.safetensors"
    with safe_open(lora_file, "pt") as f:
        keys, metadata = list(f.keys()), f.metadata()
    assert keys and all(k.startswith("transformer.") and k.endswith(
        (".lora_A.weight", ".lora_B.weight")) for k in keys)
    config = json.loads(metadata["lora_adapter_metadata"])
    assert (config["transformer.r"], config["transformer.lora_alpha"]) == (8, lora_alpha or 8)
    assert "final_lora" in (out / "summary.txt").read_text()

    merged = FluxPolicy.from_pretrained(out / "final_model")
    base = FluxPolicy.from_pretrained(EMBEDDED_MODEL)
    untrained = velocities(base)
    base.pipeline.load_lora_weights(out / "final_lora")  # diffusers' own loader
    adapted = velocities(base)
    assert not torch.allclose(adapted, untrained, atol=1e-3)  # the adapters learned something
    torch.testing.assert_close(adapted, velocities(merged), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sampled_images(base), sampled_images(merged), rtol=0, atol=1e-4)

    # the transformer alone: the merged model's transformer, loadable without the pipeline
    alone = FluxTransformer2DModel.from_pretrained(out / "final_transformer").state_dict()
    expected = merged.transformer.state_dict()
    assert alone.keys() == expected.keys()
    assert all(torch.equal(alone[k], v) for k, v in expected.items())
    assert not (out / "final_transformer" / "text_encoder_2").exists()
