"""The memory plan (`python -m chunk_grpo.plan`): meta-device parameter counts against real tiny
models, FakeTensor activation bytes against a real CPU call measured with the same probes, the
arithmetic of sharding and LoRA, the FLUX preset fitting 8 x 80 GB, the one-line error with its
levers, and the command line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from chunk_grpo.cli.plan import main as plan_main
from chunk_grpo.config.parsing import build_config
from chunk_grpo.plan.activations import (
    Adapters,
    CallPrecision,
    CallShape,
    estimate_flux_call,
    measure_flux_call,
    prepare_for_measurement,
)
from chunk_grpo.plan.memory import (
    CPU_RUNTIME_BYTES,
    GB,
    PHASES,
    PlanDoesNotFit,
    build_plan,
    check_plan,
    format_plan,
    model_sizes,
    plan_for_config,
    settings_from_config,
)
from chunk_grpo.plan.models import (
    build_clip_text,
    build_t5_encoder,
    build_transformer,
    build_vae,
    count_parameters,
    largest_lora_tensor,
    largest_tensor,
    lora_parameter_count,
    resolve_model_configs,
)
from chunk_grpo.train.phase_memory import PhaseMemory, active_phase

REPO = Path(__file__).resolve().parents[3]
PRESET = REPO / "configs" / "flux_dev_hpsv3.yaml"
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
# A FLUX-shaped transformer small enough to run for real on the CPU in well under a second.
TINY_FLUX = dict(num_layers=2, num_single_layers=3, num_attention_heads=2, attention_head_dim=16,
                 axes_dims_rope=(4, 6, 6), in_channels=64, joint_attention_dim=32,
                 pooled_projection_dim=16, guidance_embeds=True)
SHAPE = CallShape(rows=3, image_tokens=64, text_tokens=16)


def _row(plan, part_start: str):
    return next(r for r in plan.rows if r.part.startswith(part_start))


def _embedded_cfg(overrides: dict | None = None):
    return build_config(None, {"run.device": "cuda", **(overrides or {})})


# ----------------------------------------------------------------------------- sizes on meta

def test_meta_builds_count_the_parameters_of_real_models():
    configs = resolve_model_configs("embedded")  # the shipped tiny FLUX's own config.json files
    for build, config in ((build_transformer, configs.transformer), (build_vae, configs.vae)):
        meta = build(config)
        assert all(p.is_meta for p in meta.parameters())
        assert count_parameters(meta) == count_parameters(build(config, device="cpu"))
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    assert count_parameters(build_clip_text(configs.text_encoder)) == count_parameters(
        CLIPTextModel(CLIPTextConfig(**configs.text_encoder)))
    assert count_parameters(build_t5_encoder(configs.text_encoder_2)) == count_parameters(
        T5EncoderModel(T5Config(**configs.text_encoder_2)))


def test_flux_dev_configs_give_the_published_sizes():
    configs = resolve_model_configs("black-forest-labs/FLUX.1-dev")
    assert count_parameters(build_transformer(configs.transformer)) == 11_901_408_320  # "12B"
    assert count_parameters(build_t5_encoder(configs.text_encoder_2)) == 4_762_310_656


def test_lora_count_equals_peft_on_a_real_model():
    real = build_transformer(TINY_FLUX, device="cpu").requires_grad_(False)
    real.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(ATTENTION)))
    added = sum(p.numel() for p in real.parameters() if p.requires_grad)
    assert lora_parameter_count(build_transformer(TINY_FLUX), 4, list(ATTENTION)) == added
    largest = max(p.numel() for p in real.parameters() if p.requires_grad)
    assert largest_lora_tensor(build_transformer(TINY_FLUX), 4, list(ATTENTION)) == largest
    with pytest.raises(ValueError, match="neither a preset"):
        lora_parameter_count(build_transformer(TINY_FLUX), 4, ["no_such_module"])


# ----------------------------------------------------------------------------- activations

@pytest.mark.parametrize("train,checkpointing,adapters,precision", [
    (True, False, Adapters(), CallPrecision()),
    (True, True, Adapters(4, ATTENTION),
     CallPrecision(torch.float32, torch.bfloat16, torch.bfloat16)),
    (False, False, Adapters(), CallPrecision(torch.float32, torch.float32, torch.bfloat16)),
])
def test_fake_tensor_estimate_equals_a_real_cpu_call(train, checkpointing, adapters, precision):
    """Tolerance: none. The FakeTensor runs of 1-2 blocks, extrapolated to 2 double + 3 single
    blocks, give the real call's bytes exactly (saved for backward, forward and backward peaks),
    because both run the same aten ops with the same shapes and dtypes."""
    torch.manual_seed(0)
    real = prepare_for_measurement(build_transformer(TINY_FLUX, device="cpu"), train=train,
                                   gradient_checkpointing=checkpointing, adapters=adapters,
                                   precision=precision)
    measured = measure_flux_call(real, SHAPE, train=train, autocast=precision.autocast)
    estimated = estimate_flux_call(TINY_FLUX, SHAPE, train=train,
                                   gradient_checkpointing=checkpointing, adapters=adapters,
                                   precision=precision)
    assert measured.forward_peak > 0 and (measured.saved > 0) == train
    assert (estimated.saved, estimated.forward_peak, estimated.backward_peak) == \
        (measured.saved, measured.forward_peak, measured.backward_peak)


def test_checkpointing_saves_less_and_the_saved_bytes_scale_with_rows():
    one_each = dict(TINY_FLUX, num_layers=1, num_single_layers=1)  # one FakeTensor run each
    plain = estimate_flux_call(one_each, SHAPE, train=True)
    checkpointed = estimate_flux_call(one_each, SHAPE, train=True, gradient_checkpointing=True)
    assert checkpointed.saved < plain.saved / 3 and checkpointed.peak < plain.peak
    double = estimate_flux_call(one_each, CallShape(6, 64, 16), train=True)
    assert double.saved == pytest.approx(2 * plain.saved, rel=0.02)


# ----------------------------------------------------------------------------- arithmetic

def test_fsdp_divides_weights_gradients_and_optimizer_by_the_world_size():
    cfg = _embedded_cfg(overrides={"parallel.mode": "fsdp", "model.lora_rank": 0})
    one, eight = (plan_for_config(cfg, n, 80 * GB) for n in (1, 8))
    for part in ("trainable weights", "optimizer state", "gradients", "hybrid-evaluation base"):
        assert _row(eight, part).gpu_bytes == pytest.approx(_row(one, part).gpu_bytes / 8)
        assert _row(one, part).gpu_bytes > 0
    assert _row(eight, "VAE").gpu_bytes == _row(one, "VAE").gpu_bytes  # not sharded
    ddp = plan_for_config(_embedded_cfg(overrides={"parallel.mode": "ddp", "model.lora_rank": 0}),
                          8, 80 * GB)
    assert _row(ddp, "trainable weights").gpu_bytes == _row(one, "trainable weights").gpu_bytes
    assert _row(ddp, "DDP gradient buckets").gpu_bytes == _row(ddp, "gradients").gpu_bytes


def test_lora_trains_adapters_over_a_frozen_base_and_needs_no_base_copy():
    full = plan_for_config(_embedded_cfg(overrides={"model.lora_rank": 0,
                                                    "model.weights_dtype": "bf16"}), 1, 80 * GB)
    lora = plan_for_config(_embedded_cfg(overrides={"model.lora_rank": 8,
                                                    "model.weights_dtype": "bf16"}), 1, 80 * GB)
    params = count_parameters(build_transformer(resolve_model_configs("embedded").transformer))
    adapters = lora_parameter_count(build_transformer(
        resolve_model_configs("embedded").transformer), 8, list(lora.settings.lora_targets))
    assert _row(full, "trainable weights").gpu_bytes == 4 * params
    assert _row(full, "optimizer state").gpu_bytes == 8 * params
    assert _row(full, "frozen weights").gpu_bytes == 0
    assert _row(full, "hybrid-evaluation base").gpu_bytes == 2 * params  # one bf16 copy
    assert _row(lora, "trainable weights").gpu_bytes == 4 * adapters
    assert _row(lora, "frozen weights").gpu_bytes == 2 * params
    assert _row(lora, "hybrid-evaluation base").gpu_bytes == 0
    eight_bit = plan_for_config(_embedded_cfg(overrides={"model.lora_rank": 0,
                                                         "optim.name": "adamw8bit"}), 1, 80 * GB)
    assert _row(eight_bit, "optimizer state").gpu_bytes == pytest.approx(2.03125 * params)


def test_text_encoder_placement_and_cpu_offload():
    keep = plan_for_config(_embedded_cfg(overrides={"model.text_encoders": "keep"}), 1, 80 * GB)
    assert _row(keep, "text encoders").gpu_bytes > 0
    for mode in ("cache", "cpu"):
        plan = plan_for_config(_embedded_cfg(overrides={"model.text_encoders": mode}), 1, 80 * GB)
        assert _row(plan, "text encoders").gpu_bytes == 0
    offload = plan_for_config(_embedded_cfg(overrides={"parallel.mode": "fsdp",
                                                       "parallel.cpu_offload": True,
                                                       "model.lora_rank": 0}),
                              2, 80 * GB)
    for part in ("trainable weights", "optimizer state", "gradients"):
        assert _row(offload, part).gpu_bytes == 0 and _row(offload, part).where == "CPU"


@pytest.mark.slow
def test_flux_preset_fits_eight_80gb_gpus(capsys):
    plan = plan_main(["--config", str(PRESET), "--gpus", "8", "--gpu-memory", "80"])
    out = capsys.readouterr().out
    assert plan.fits and "fits: peak" in out and "does not fit" not in out
    assert plan.settings.parallelism == "fsdp" and plan.settings.lora_rank == 0
    assert 40 * GB < plan.peak_bytes < 80 * GB
    assert _row(plan, "trainable weights").gpu_bytes == pytest.approx(4 * 11_901_408_320 / 8)


def test_a_config_that_cannot_fit_names_the_levers_by_effect():
    cfg = _embedded_cfg(overrides={"model.lora_rank": 0, "optim.micro_batch_size": 8})
    with pytest.raises(PlanDoesNotFit) as err:
        check_plan(cfg, 2, 0.01 * GB)
    message = str(err.value)
    assert "\n" not in message and "over the 0.0 GB budget" in message
    for lever in ("parallel.mode: fsdp", "optim.name: adamw8bit", "gradient_checkpointing: true",
                  "micro_batch_size: 4", "text_encoders: cache", "lora_rank: 64"):
        assert lever in message
    savings = [float(part.split("(-")[1].split(" GB")[0])
               for part in message.split("levers by effect: ")[1].split("), ")]
    assert savings == sorted(savings, reverse=True)
    fits = check_plan(cfg, 2, 80 * GB)
    assert fits.fits and fits.margin_bytes > 0


def test_settings_resolve_dtypes_per_device():
    cuda = settings_from_config(_embedded_cfg(), 1)
    assert (cuda.compute_dtype, cuda.weights_dtype) == ("bf16", "bf16")
    cpu = settings_from_config(build_config(None, {"run.device": "cpu",
                                                   "model.mixed_precision": "no"}), 1)
    assert (cpu.compute_dtype, cpu.weights_dtype) == ("fp32", "fp32")
    plan = build_plan(cuda, 80 * GB)
    assert _row(plan, "CUDA context").gpu_bytes == 3 * GB


# ----------------------------------------------------------------------------- command line

def test_cli_writes_json_and_exits_1_when_it_does_not_fit(tmp_path, capsys):
    out = tmp_path / "plan.json"
    plan_main(["--gpus", "1", "--gpu-memory", "80", "--run.device", "cuda", "--json", str(out)])
    data = json.loads(out.read_text())
    assert [p["name"] for p in data["phases"]] == list(PHASES)
    assert data["fits"] and data["peak_bytes"] == max(p["gpu_bytes"] for p in data["phases"])
    peak = next(p for p in data["phases"] if p["name"] == data["peak_phase"])
    assert peak["gpu_bytes"] == pytest.approx(sum(peak["gpu_parts"].values()))
    assert data["host_peak_bytes"] == max(p["host_bytes"] for p in data["phases"]) > 0
    assert set(data["train_by_reduce_dtype"]) == {"fp32", "bf16"}
    with pytest.raises(SystemExit) as stop:
        plan_main(["--gpu-memory", "0.5", "--run.device", "cuda"])
    assert stop.value.code == 1
    assert "does not fit" in capsys.readouterr().out


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "chunk_grpo.plan", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_cli_help_and_bad_flags_answer_in_one_line():
    help_text = _run("--help")
    assert help_text.returncode == 0 and "--gpu-memory" in help_text.stdout
    for args, expected in ((("--gpus", "0"), "must be >= 1"),
                           (("--lora-rnak", "4"), "did you mean 'model.lora_rank'")):
        result = _run(*args)
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- phases

def _part(phase, name: str) -> float:
    return dict(phase.gpu_parts).get(name, 0.0)


def _flux_blocks():
    from chunk_grpo.plan.models import transformer_blocks

    meta = build_transformer(resolve_model_configs("embedded").transformer)
    return meta, [count_parameters(b) for b in transformer_blocks(meta)]


def test_every_phase_in_order_and_the_peak_is_the_largest():
    plan = plan_for_config(_embedded_cfg(overrides={"parallel.mode": "fsdp", "model.lora_rank": 0,
                                                    "eval.hybrid_steps": 2}),
                           4, 80 * GB)
    assert [p.name for p in plan.phases] == list(PHASES)
    largest = max(plan.phases, key=lambda p: p.gpu_bytes)
    assert (plan.peak_phase, plan.peak_bytes) == (largest.name, largest.gpu_bytes)
    assert plan.peak_phase in plan.verdict()
    # The optimizer state exists from the first step on: in the rollout, not at load.
    opt = _row(plan, "optimizer state").gpu_bytes
    assert _part(plan.phase("rollout"), "optimizer state") == opt > 0
    assert _part(plan.phase("load"), "optimizer state") == 0


def test_fsdp_accumulation_keeps_only_gradient_shards_and_one_block_in_flight():
    """FSDP reduce-scatters every micro-batch: the train phase holds the fp32 gradient shards
    (4 B/param / world) and one block's unsharded gradient, never a full gradient; DDP holds a
    full gradient and its buckets."""
    meta, blocks = _flux_blocks()
    params = count_parameters(meta)
    cfg = _embedded_cfg(overrides={"parallel.mode": "fsdp", "model.lora_rank": 0,
                                   "optim.grad_accum": 12,
                                   "optim.micro_batch_size": 1})
    train = plan_for_config(cfg, 8, 80 * GB).phase("train")
    assert _part(train, "gradients") == pytest.approx(4 * params / 8)
    assert _part(train, "gradient in flight / buckets") == pytest.approx((2 + 4) * max(blocks))
    # No unsharded full gradient: what the gradients take is less than one full fp32 copy.
    assert _part(train, "gradients") + _part(train, "gradient in flight / buckets") < 4 * params
    pairs = max(a + b for a, b in zip(blocks, blocks[1:], strict=False))
    root = params - sum(blocks)
    assert _part(train, "FSDP unsharded blocks") == pytest.approx(2 * (pairs + root))
    # A no-grad forward: the root, the previous group's all-gather buffer (kept until the next
    # copy-out) and a block's buffer and unsharded copy.
    previous = [root, *blocks[:-1]]
    forward = root + max(p + 2 * b for p, b in zip(previous, blocks, strict=True))
    rollout = plan_for_config(cfg, 8, 80 * GB).phase("rollout")
    assert _part(rollout, "FSDP unsharded blocks") == pytest.approx(2 * forward)
    ddp = plan_for_config(_embedded_cfg(overrides={"parallel.mode": "ddp", "model.lora_rank": 0,
                                                   "optim.grad_accum": 12}), 8,
                          80 * GB).phase("train")
    assert _part(ddp, "gradients") == _part(ddp, "gradient in flight / buckets") == 4 * params


def test_reduce_dtype_changes_only_the_gradient_in_flight():
    _, blocks = _flux_blocks()
    settings = settings_from_config(_embedded_cfg(overrides={"parallel.mode": "fsdp",
                                                             "model.lora_rank": 0}), 8)
    fp32 = build_plan(settings, 80 * GB)
    bf16 = build_plan(dataclasses.replace(settings, reduce_dtype="bf16"), 80 * GB)
    assert fp32.train_by_reduce_dtype == bf16.train_by_reduce_dtype
    saved = fp32.train_by_reduce_dtype["fp32"] - fp32.train_by_reduce_dtype["bf16"]
    assert saved == pytest.approx(2 * max(blocks))  # fp32 -> bf16 copy of the largest block
    assert fp32.phase("train").gpu_bytes - bf16.phase("train").gpu_bytes == pytest.approx(saved)
    assert fp32.phase("rollout").gpu_bytes == bf16.phase("rollout").gpu_bytes
    assert "train by parallel.reduce_dtype: fp32" in format_plan(fp32)


def test_host_memory_per_node():
    """Load: the checkpoint files' page cache once per node plus one full tensor per rank;
    export: rank 0 holds the gathered fp32 transformer (and the reloaded text encoders)."""
    meta, _ = _flux_blocks()
    params, tensor = count_parameters(meta), largest_tensor(meta)
    cfg = _embedded_cfg(overrides={"parallel.mode": "fsdp", "model.lora_rank": 0,
                                   "model.text_encoders": "cache"})
    eight = plan_for_config(cfg, 16, 80 * GB)  # two nodes of 8
    four = plan_for_config(cfg, 16, 80 * GB, gpus_per_node=4)
    files = model_sizes("embedded").files
    page_cache = files["transformer"] + files["text_encoders"] + files["vae"]
    assert files["transformer"] > 0
    # Each rank reads its rows of one tensor at a time: a slice in the checkpoint's dtype and,
    # into a CUDA tensor of another dtype, its fp32 conversion on the host; never a full tensor.
    in_slice = (files["transformer"] / params + 4) * tensor / 16
    assert eight.phase("load").host_bytes == pytest.approx(page_cache + 8 * in_slice)
    assert four.phase("load").host_bytes == pytest.approx(page_cache + 4 * in_slice)
    assert _part(eight.phase("load"), "one full tensor in flight") == 0
    # A CPU run holds the rows it maps while filling in its own resident memory.
    cpu = plan_for_config(cfg, 2, 80 * GB, device="cpu").phase("load")
    assert cpu.process_bytes >= files["transformer"] / 2 + _part(cpu, "trainable weights")
    export = dict(eight.phase("export").host_parts)
    assert export["rank 0: the gathered transformer"] == 4 * params
    assert export["rank 0: text encoders reloaded"] == 2 * model_sizes("embedded").text_encoders
    assert _part(eight.phase("export"), "one full tensor in flight") == 4 * tensor
    assert eight.host_peak_bytes == max(p.host_bytes for p in eight.phases)


def test_check_plan_names_the_phase_over_the_budget():
    cfg = _embedded_cfg(overrides={"parallel.mode": "fsdp", "model.lora_rank": 0,
                                   "model.text_encoders": "cache"})
    plan = plan_for_config(cfg, 2, 80 * GB, device="cuda")
    ordered = sorted(plan.phases, key=lambda p: p.gpu_bytes)
    top, second = ordered[-1], ordered[-2]
    assert top.gpu_bytes > second.gpu_bytes
    with pytest.raises(PlanDoesNotFit, match=f"the {top.name} phase peaks at"):
        check_plan(cfg, 2, (top.gpu_bytes + second.gpu_bytes) / 2)
    assert check_plan(cfg, 2, top.gpu_bytes).peak_phase == top.name


def test_phase_memory_measures_a_known_allocation_on_the_cpu():
    """Tolerance 15%: the peak is the resident memory's high-water mark, which also sees the
    allocator's and the interpreter's own pages."""
    memory = PhaseMemory("cpu")
    size = 400 * 10**6
    with memory.activate():
        with active_phase("big"):
            held = memory._current_bytes() - memory.baseline
            tensor = torch.ones(size // 4)
            del tensor
        with active_phase("small"):
            torch.ones(size // 40).sum()
    report = memory.report()["phases"]
    assert report["big"]["peak_bytes"] - held == pytest.approx(size, rel=0.15)
    assert report["small"]["peak_bytes"] < report["big"]["peak_bytes"] / 2  # the mark was reset
    assert report["big"]["calls"] == 1 and report["big"]["seconds"] > 0
    assert memory.metrics()["memory/big_gb"] == pytest.approx(report["big"]["peak_bytes"] / GB)
    with active_phase("outside"):  # no active recorder: nothing recorded
        pass
    assert "outside" not in memory.report()["phases"]


# ----------------------------------------------------------------------------- checkpoint

def _lora_trainer(ema_decay: float):
    """What `trainer_state` reads of a trainer: a real tiny LoRA transformer after one AdamW
    step, its schedule and EMA."""
    from types import SimpleNamespace

    from chunk_grpo.train.optim import EMA

    real = build_transformer(TINY_FLUX, device="cpu").requires_grad_(False)
    real.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(ATTENTION)))
    named = [(n, p) for n, p in real.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([p for _, p in named])
    sum(p.sum() for _, p in named).backward()
    optimizer.step()
    return SimpleNamespace(
        policy=SimpleNamespace(transformer=real), module=real, optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        ema=EMA(named, ema_decay) if ema_decay else None, layout=SimpleNamespace(sizes=(2, 2)),
        chunk_weights=None, cfg=build_config(None, {}), counts={}, chunk_counts=[0, 0]), named


@pytest.mark.parametrize("ema_decay", [0.0, 0.9])
def test_a_one_process_checkpoint_copies_what_the_plan_counts(ema_decay):
    """`trainer_state` hands DCP the live trained weights, optimizer state and EMA averages
    (no copies); the plan's checkpoint phase counts none, the NaN/Inf mask of one tensor and,
    on CUDA only, the host copy of the largest trained tensor (a CPU tensor is written from its
    own memory)."""
    from chunk_grpo.train.run_checkpoint import trainer_state

    tr, named = _lora_trainer(ema_decay)
    live = [*tr.policy.transformer.parameters(), *tr.policy.transformer.buffers(),
            *[t for st in tr.optimizer.state.values() for t in st.values()
              if isinstance(t, torch.Tensor)], *(tr.ema.shadow.values() if tr.ema else ())]
    owned = {t.untyped_storage().data_ptr() for t in live}
    state = {name: value.state_dict() for name, value in trainer_state(tr).items()
             if name != "run"}  # the run's: plain values and the RNG states
    assert set(state) == ({"model", "optimizer", "ema"} if ema_decay else {"model", "optimizer"})
    copies = {}

    def walk(value):
        if isinstance(value, torch.Tensor):
            if value.untyped_storage().data_ptr() not in owned:
                copies[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif isinstance(value, dict | list | tuple):
            for v in value.values() if isinstance(value, dict) else value:
                walk(v)

    walk(state)
    assert copies == {}

    cfg = _embedded_cfg(overrides={"model.lora_rank": 8, "optim.ema_decay": ema_decay,
                                   "parallel.mode": "none"})
    rank = plan_for_config(cfg, 1, 80 * GB)
    largest = largest_lora_tensor(build_transformer(resolve_model_configs("embedded").transformer),
                                  8, list(rank.settings.lora_targets))
    for device in ("cuda", "cpu"):
        checkpoint = plan_for_config(cfg, 1, 80 * GB, device=device).phase("checkpoint")
        assert _part(checkpoint, "NaN/Inf check mask") == largest
        assert not [name for name, _ in checkpoint.gpu_parts if "cloned" in name]
        assert checkpoint.host_rank_bytes == (4 * largest if device == "cuda" else 0)
    full = plan_for_config(_embedded_cfg({"model.lora_rank": 0, "parallel.mode": "none"}), 1,
                           80 * GB)
    meta = build_transformer(resolve_model_configs("embedded").transformer)
    assert full.phase("checkpoint").host_rank_bytes == 4 * largest_tensor(meta)


def test_a_cpu_run_holds_its_runtime_from_the_first_iteration_on():
    """The process's growth above its post-import memory (kernel code, lazy imports, small
    objects) counts on a CPU run in the phases from the rollout on; never on a GPU."""
    cfg = _embedded_cfg(overrides={"parallel.mode": "none"})
    cpu = plan_for_config(cfg, 1, 80 * GB, device="cpu")
    for phase in cpu.phases:
        before = phase.name in ("load", "prompt_cache", "profile")
        assert _part(phase, "CPU runtime") == (0 if before else CPU_RUNTIME_BYTES), phase.name
    cuda = plan_for_config(cfg, 1, 80 * GB, device="cuda")
    assert all(_part(phase, "CPU runtime") == 0 for phase in cuda.phases)
