"""The paper's preset, configs/flux_dev_hpsv3.yaml, runs one iteration on the CPU: a FLUX.1-dev-
shaped model (its block structure, guidance embedding, 16-channel VAE with its scaling and shift,
text widths and scheduler config, at toy width and depth) and a tiny HPSv3 in the authors'
checkpoint layout, through `python -m chunk_grpo.train --config` in a subprocess. Only the
overrides the CPU and the toy scale need are given (see FLUX_PRESET_OVERRIDES)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from diffusers import FlowMatchEulerDiscreteScheduler
from hpsv3_tiny import save_tiny_hpsv3

from chunk_grpo.config.parsing import build_config, load_saved_config
from chunk_grpo.models.sampling_defaults import CONFIG_NAME
from chunk_grpo.models.tiny import build_tiny_flux_pipeline
from chunk_grpo.train.checkpoint import latest_checkpoint
from chunk_grpo.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "configs" / "flux_dev_hpsv3.yaml"

# FLUX.1-dev's scheduler/scheduler_config.json.
FLUX_DEV_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                          base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                          max_image_seq_len=4096)
# FLUX.1-dev's structure (guidance embedding, 16 latent channels -> in_channels 64, T5-XXL's 4096
# and CLIP-L's 768 text widths, 4-level VAE with mid-block attention and its scaling/shift) at
# toy width and depth: 1 double + 1 single block, 2 heads of 16.
FLUX_DEV_SHAPED = dict(
    num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=16,
    axes_dims_rope=(4, 6, 6), guidance_embeds=True,
    latent_channels=16, vae_block_out_channels=(8, 8, 16, 16), vae_norm_num_groups=4,
    vae_scaling_factor=0.3611, vae_shift_factor=0.1159, vae_mid_block_attention=True,
    t5_d_model=4096, t5_heads=2, t5_d_kv=8, t5_d_ff=32,
    clip_hidden=768, clip_heads=2, clip_intermediate=32,
)
TRAIN_PROMPTS = ["a red cat on a sofa", "a blue car in the rain", "a portrait of an old man",
                 "a castle on a hill at sunset"]
EVAL_PROMPTS = ["a green apple on a table", "a dog running on the beach"]


def save_flux_dev_shaped(directory: Path) -> Path:
    """The FLUX.1-dev-shaped toy pipeline, saved like FLUX.1-dev itself: no chunk_grpo.json, so
    the loader uses FLUX.1-dev's sampling defaults (512 T5 tokens, guidance 3.5) and the image
    size must come from the command line."""
    words = sorted({w for p in TRAIN_PROMPTS + EVAL_PROMPTS for w in p.split()})
    pipeline = build_tiny_flux_pipeline(words, **FLUX_DEV_SHAPED)
    pipeline.register_modules(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER))
    pipeline.save_pretrained(directory)
    return directory


def write_reward_module(directory: Path, hpsv3_dir: Path) -> str:
    """A user module registering the tiny HPSv3 checkpoint (README, "Your own reward")."""
    (directory / "flux_preset_reward.py").write_text(
        "from functools import partial\n"
        "from chunk_grpo.rewards import HPSv3Reward, register_reward\n"
        f"register_reward('tiny_hpsv3')(partial(HPSv3Reward, model={str(hpsv3_dir)!r}))\n")
    return "flux_preset_reward:tiny_hpsv3"


def preset_overrides(tmp_path: Path, model: Path, reward: str, out: Path) -> list[str]:
    """Every flag that departs from the preset, with the reason."""
    train = tmp_path / "train_prompts.txt"
    train.write_text("\n".join(TRAIN_PROMPTS) + "\n")
    heldout = tmp_path / "test_prompts.txt"
    heldout.write_text("\n".join(EVAL_PROMPTS) + "\n")
    return ["--model.name", str(model), "--reward.name", reward, "--data.train_prompts",
            str(train), "--data.eval_prompts", str(heldout), "--run.output_dir", str(out),
            "--run.device", "cpu", "--model.height", "64", "--model.width", "64",
            "--run.max_steps", "1", "--eval.images", "2", "--eval.final_images", "2",
            "--run.progress", "false", "--model.prompt_cache_dir", str(tmp_path / "prompt-cache")]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_flux_dev_preset_runs_one_iteration_on_cpu(tmp_path, ranks):
    """One process, and 2 gloo ranks under torchrun with the preset's FSDP2 (each rank its 2
    prompts, the transformer loaded straight into its shards, a sharded checkpoint, the
    evaluation split and the gathered export). The preset's own accumulation: groups of 12,
    24 rows per rank as 24 micro-batches of 1 row, an optimizer step every 12 (gradients
    reduce-scattered every micro-batch), so 2 optimizer steps."""
    model = save_flux_dev_shaped(tmp_path / "flux-dev-shaped")
    assert not (model / CONFIG_NAME).exists()
    hpsv3_dir = tmp_path / "hpsv3"
    hpsv3_dir.mkdir()
    save_tiny_hpsv3(hpsv3_dir)
    reward = write_reward_module(tmp_path, hpsv3_dir)
    out = tmp_path / "run"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] \
        if ranks == 2 else []
    command = [sys.executable, *launcher, "-m", "chunk_grpo.train", "--config", str(PRESET),
               *preset_overrides(tmp_path, model, reward, out)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO),
                                           os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]

    # The preset's settings reached the run, the overrides only where given.
    saved = load_saved_config(out / "config.yaml")
    preset = build_config(PRESET)
    for key in ("sampling.group_size", "optim.micro_batch_size", "optim.grad_accum",
                "parallel.mode", "model.weights_dtype", "sampling.steps", "sampling.batch_size",
                "sampling.shift", "sampling.dynamic_shift", "sampling.sde", "sampling.eta",
                "sampling.cfg_scale", "sampling.prompts_per_step", "sampling.sde_window",
                "chunks.spec", "chunks.fraction", "chunks.weighted", "loss.clip_low",
                "loss.clip_high", "optim.lr", "optim.max_grad_norm", "model.lora_rank",
                "model.gradient_checkpointing", "model.mixed_precision", "eval.hybrid_steps"):
        assert saved.get(key) == preset.get(key), key
    assert (saved.model.height, saved.model.width, saved.run.device) == (64, 64, "cpu")

    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1]
    assert records[0]["optimizer_steps"] == 2
    for key in ("reward_mean", "loss", "grad_norm"):
        assert math.isfinite(records[0][key]), (key, records[0][key])
    assert latest_checkpoint(out) is not None
    assert (latest_checkpoint(out) / "shards").is_dir() == (ranks == 2)  # DCP shards per rank
    exported = json.loads((out / "final_model" / "transformer" / "config.json").read_text())
    assert exported["guidance_embeds"] and exported["in_channels"] == 64
    vae = json.loads((out / "final_model" / "vae" / "config.json").read_text())
    assert (vae["latent_channels"], vae["scaling_factor"], vae["shift_factor"]) == \
        (16, 0.3611, 0.1159)
    assert (out / "final_model" / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval"]["n"] == 2
    assert "paired gain" in (out / "summary.txt").read_text()
