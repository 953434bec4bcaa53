"""Checkpoints across world sizes: saved by 2 FSDP ranks (each its own shards), resumed on 2
ranks (FSDP and DDP) and on one plain process with the same weights and optimizer state; the
final export is gathered to the CPU as bf16 safetensors that diffusers loads; resuming at another
world size keeps the global batch or says why it cannot."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from parallel_utils import (
    build_transformer,
    full_trainable_state,
    make_optimizer,
    output_of,
    step_batch,
    train,
)
from safetensors import safe_open
from spawn_ranks import run_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from trainer_utils import TINY_SIZES

from chunk_grpo.models.policy_setup import merged_transformer
from chunk_grpo.models.tiny import build_tiny_flux_pipeline
from chunk_grpo.runtime.parallelize import parallelize_transformer, trainable_parameters
from chunk_grpo.train.checkpoint import (
    CheckpointError,
    DiskFullError,
    ModelState,
    OptimizerState,
    find_resumable,
    latest_checkpoint,
    read_checkpoint,
    restore_checkpoint,
    save_checkpoint,
    select_checkpoint,
)
from chunk_grpo.train.export import LORA_FILE, export_full_model, export_targets
from chunk_grpo.train.run_checkpoint import WorldSizeError, resume_batch_plan


def full_optimizer_state(model, optimizer) -> dict:
    """The optimizer state keyed by parameter name, gathered in full (every rank calls)."""
    _, state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {name: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                   for k, v in entry.items()} for name, entry in state["state"].items()}


def save_model(run_dir, step, model, optimizer, run: dict, **extra) -> None:
    save_checkpoint(run_dir, step, {"model": ModelState(model),
                                    "optimizer": OptimizerState(model, optimizer), "run": run,
                                    **extra})


def load_model(path, model, optimizer, **extra) -> dict:
    """Load a checkpoint (or a run's newest intact one) into ``model`` and ``optimizer`` (and
    ``extra`` tensors) in place; its "run" values."""
    path = select_checkpoint(path)
    restore_checkpoint(path, {"model": ModelState(model),
                              "optimizer": OptimizerState(model, optimizer), **extra})
    return read_checkpoint(path, ("run",))["run"]


def save_on_two_ranks(rank, world, tmp, run_dir):
    """2 optimizer steps under FSDP (LoRA), a sharded checkpoint, then the bf16 exports."""
    model = build_transformer(True)
    call = parallelize_transformer(model, mode="fsdp", device="cpu", param_dtype=None)
    params = trainable_parameters(call)
    optimizer = make_optimizer(params)
    train(call, params, rank, world, optimizer=optimizer, steps=range(2))
    save_model(run_dir, 2, call, optimizer, {"scheduler": "last 2", "rank": {f"{rank}": rank}})
    pipeline = build_tiny_flux_pipeline(["red", "cat"], **TINY_SIZES)
    written = export_full_model(pipeline, call, export_targets(run_dir, ["auto", "transformer"],
                                                               lora=True))
    assert list(written) == (["merged", "lora", "transformer"] if rank == 0 else [])
    return full_trainable_state(call), full_optimizer_state(call, optimizer)


def resume_on_two_ranks(rank, world, tmp, run_dir):
    """Fresh models loading the checkpoint under FSDP and under DDP. Their adapters start from
    the untrained initialisation; the frozen base is the saved run's (as from the model files)."""
    loaded = {}
    for mode in ("fsdp", "ddp"):
        model = build_transformer(True)
        call = parallelize_transformer(model, mode=mode, device="cpu", param_dtype=None)
        optimizer = make_optimizer(trainable_parameters(call))
        trainer = load_model(run_dir, call, optimizer)
        loaded[mode] = (full_trainable_state(call), full_optimizer_state(call, optimizer),
                        trainer)
    # the export from the DDP wrapper (the resumed weights): gathered the same way
    export_full_model(build_tiny_flux_pipeline(["red", "cat"], **TINY_SIZES), call,
                      tmp / "final_ddp")
    return loaded


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    run_dir = tmp / "run"
    states = run_ranks(save_on_two_ranks, 2, tmp, run_dir)
    return run_dir, states


def assert_same_state(actual, expected):
    (params, optim), (ref_params, ref_optim) = actual, expected
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0)
    assert optim.keys() == ref_optim.keys() == ref_params.keys()
    for name, entry in ref_optim.items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(torch.as_tensor(optim[name][key]),
                                       torch.as_tensor(entry[key]), rtol=0, atol=0)


@pytest.mark.slow
def test_checkpoint_is_sharded_with_a_manifest(saved):
    run_dir, states = saved
    path = latest_checkpoint(run_dir)
    assert path.name == "step-00000002" and find_resumable(run_dir) == path
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "dcp" and manifest["world_size"] == 2
    shards = sorted(p.name for p in path.glob("*.distcp"))
    assert len(shards) == 2  # one file per rank, nothing gathered on rank 0
    assert set(manifest["files"]) == {*shards, ".metadata"}
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    # the two ranks hold the same (global) view of the trained weights
    assert_same_state(states[1], states[0])


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_two_ranks(saved, tmp_path):
    run_dir, states = saved
    for mode, (params, optim, trainer) in run_ranks(resume_on_two_ranks, 2, tmp_path,
                                                    run_dir)[1].items():
        assert_same_state((params, optim), states[0]), mode
        # plain values: one copy of equal ones, each rank's own under its own name
        assert trainer == {"scheduler": "last 2", "rank": {"0": 0, "1": 1}}
    name = "transformer/diffusion_pytorch_model.safetensors"
    ddp_export = next(tmp_path.glob("ranks-*/final_ddp")) / name
    assert ddp_export.read_bytes() == (run_dir / "final_model" / name).read_bytes()


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_process(saved):
    run_dir, states = saved
    model = build_transformer(True, seed=1)
    optimizer = make_optimizer(trainable_parameters(model))
    trainer = load_model(run_dir, model, optimizer)
    assert_same_state((full_trainable_state(model), full_optimizer_state(model, optimizer)),
                      states[0])
    assert trainer["scheduler"] == "last 2"
    # before any model is built: every tensor in full, from the metadata alone
    assert read_checkpoint(latest_checkpoint(run_dir), ("model",))["model"].keys() == (
        states[0][0].keys())
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        select_checkpoint(run_dir / "final_model")
    full = build_transformer(False)  # full fine-tuning: not the weights the checkpoint trains
    with pytest.raises(CheckpointError, match="another LoRA / model configuration"):
        load_model(run_dir, full, make_optimizer(trainable_parameters(full)))


@pytest.mark.slow
def test_export_is_bf16_diffusers_with_the_trained_weights(saved):
    run_dir, states = saved
    trained = states[0][0]
    reference = build_transformer(True)
    reference.load_state_dict(trained, strict=False)
    expected = merged_transformer(reference).state_dict()
    directory = run_dir / "final_model" / "transformer"
    with safe_open(directory / "diffusion_pytorch_model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    loaded = FluxTransformer2DModel.from_pretrained(directory, torch_dtype=torch.bfloat16)
    state = loaded.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(state[name], value.to(torch.bfloat16)), name
    assert (run_dir / "final_model" / "model_index.json").is_file()


@pytest.mark.slow
def test_two_rank_lora_export_loads_in_diffusers(saved):
    run_dir, states = saved
    trained = states[0][0]  # the adapters, "transformer_blocks.0.attn.to_q.lora_A.default.weight"
    with safe_open(run_dir / "final_lora" / LORA_FILE, "pt") as f:
        lora = {k: f.get_tensor(k) for k in f.keys()}
    expected = {"transformer." + k.replace(".default.", "."): v.to(torch.bfloat16)
                for k, v in trained.items()}
    assert lora.keys() == expected.keys()
    assert all(torch.equal(lora[k], v) for k, v in expected.items())
    # diffusers' loader on the base transformer computes what base + trained adapters compute
    pipeline = FluxPipeline.from_pretrained(run_dir / "final_model")
    pipeline.transformer = build_transformer(False)
    pipeline.load_lora_weights(run_dir / "final_lora")
    reference = build_transformer(True)
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in trained.items()},
                              strict=False)
    batch = step_batch(5)
    with torch.no_grad():
        torch.testing.assert_close(output_of(pipeline.transformer, batch, slice(0, 4)),
                                   output_of(reference, batch, slice(0, 4)),
                                   rtol=1e-5, atol=1e-6)
    # the transformer alone is the merged pipeline's transformer, byte for byte
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        assert ((run_dir / "final_transformer" / name).read_bytes()
                == (run_dir / "final_model" / "transformer" / name).read_bytes())


@pytest.mark.slow
def test_a_damaged_shard_is_refused_and_skipped(saved, tmp_path):
    run_dir, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    shard = next(latest_checkpoint(copy).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the sha256 sees it
    shard.write_bytes(bytes(data))
    model = build_transformer(True)
    with pytest.raises(CheckpointError, match="does not match its manifest"):
        load_model(latest_checkpoint(copy), model, make_optimizer(trainable_parameters(model)))
    shard.write_bytes(bytes(data[:-10]))  # truncated: resuming finds no intact checkpoint
    with pytest.raises(CheckpointError, match="truncated"):
        find_resumable(copy)


def test_resume_plan_keeps_the_global_batch():
    plan = resume_batch_plan(saved_world_size=2, saved_prompts_per_step=2, saved_grad_accum=2,
                             world_size=1)
    assert (plan.prompts_per_step, plan.grad_accum) == (4, 4)
    assert "prompts_per_step 2 -> 4" in plan.message and "stays 4 prompts" in plan.message
    plan = resume_batch_plan(saved_world_size=2, saved_prompts_per_step=4, saved_grad_accum=0,
                             world_size=4)
    assert (plan.prompts_per_step, plan.grad_accum) == (2, 0)
    same = resume_batch_plan(saved_world_size=8, saved_prompts_per_step=3, saved_grad_accum=6,
                             world_size=8)
    assert (same.prompts_per_step, same.grad_accum, same.message) == (3, 6, None)


def test_resume_plan_refuses_a_batch_that_cannot_be_kept():
    with pytest.raises(WorldSizeError, match=r"cannot be split over 4 ranks; resume on 1, 2, 3, "
                                             r"6 rank\(s\), or pass --sampling\.prompts_per_step"):
        resume_batch_plan(saved_world_size=2, saved_prompts_per_step=3, saved_grad_accum=0,
                          world_size=4)
    with pytest.raises(WorldSizeError, match="grad_accum 1"):  # 2 calls per step over 4 ranks
        resume_batch_plan(saved_world_size=2, saved_prompts_per_step=4, saved_grad_accum=1,
                          world_size=4)
    plan = resume_batch_plan(saved_world_size=2, saved_prompts_per_step=3, saved_grad_accum=0,
                             world_size=4, requested_prompts_per_step=2)
    assert plan.prompts_per_step == 2 and "changes from 6 to 8 prompts" in plan.message


def test_one_process_save_and_a_full_disk_keeps_the_previous(tmp_path, monkeypatch):
    model = build_transformer(True)
    params = trainable_parameters(model)
    optimizer = make_optimizer(params)
    train(model, params, 0, 1, optimizer=optimizer, steps=range(1))
    shadow = {"w": torch.arange(6.0).view(2, 3)}  # e.g. EMA weights, saved like the model's
    save_model(tmp_path, 1, model, optimizer, {"n": 1}, ema=shadow)
    first = latest_checkpoint(tmp_path)
    assert json.loads((first / "manifest.json").read_text())["world_size"] == 1
    restored = {"w": torch.zeros(2, 3)}
    assert load_model(tmp_path, model, optimizer, ema=restored)["n"] == 1
    assert torch.equal(restored["w"], shadow["w"])
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(DiskFullError, match="needs about .* the previous checkpoint .* is kept"):
        save_model(tmp_path, 2, model, optimizer, {"n": 2})
    assert latest_checkpoint(tmp_path) == first
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
