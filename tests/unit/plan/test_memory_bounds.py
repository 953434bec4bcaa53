"""Memory bounded before allocating: image size, batch, LoRA rank and rank count are checked
against the host's memory in train and evaluate, in one line, before the run directory exists
and before the model loads; the analytic activation bounds lie below the FakeTensor
measurement they stand in for."""

import dataclasses

import pytest
import torch
from trainer_utils import TINY_SIZES, tiny_config

import chunk_grpo.plan.bounds as bounds
from chunk_grpo.cli import train as train_cli
from chunk_grpo.cli.runner import run_command
from chunk_grpo.plan.activations import (
    CallPrecision,
    CallShape,
    bound_flux_call,
    bound_vae_decode,
    estimate_flux_call,
    estimate_vae_decode,
)
from chunk_grpo.plan.memory import GB, PlanDoesNotFit, build_plan, settings_from_config
from chunk_grpo.plan.models import resolve_model_configs

BUDGET = 8 * GB  # what the host is said to have, whatever this one has


@pytest.fixture
def host_has(monkeypatch):
    def set_budget(nbytes: float) -> None:
        monkeypatch.setattr(bounds, "host_available_bytes", lambda: int(nbytes))

    set_budget(BUDGET)
    return set_budget


def test_available_memory_is_memavailable_or_less_under_a_cgroup_limit(tmp_path):
    meminfo = "MemTotal:  24000000 kB\nMemFree:  1000 kB\nMemAvailable:  14000000 kB\n"
    assert bounds.host_available_bytes(meminfo, tmp_path) == 14000000 * 1024  # no cgroup files
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("5000\n")
    assert bounds.host_available_bytes(meminfo, tmp_path) == 14000000 * 1024
    (tmp_path / "memory.max").write_text(f"{4 * 2**30}\n")
    assert bounds.host_available_bytes(meminfo, tmp_path) == 4 * 2**30 - 5000
    assert bounds.host_available_bytes("MemTotal: 1 kB\n", tmp_path) is None


@pytest.mark.parametrize("train, checkpointing, autocast", [
    (False, False, None), (True, False, None), (True, False, torch.bfloat16),
    (True, True, torch.bfloat16)])
def test_the_analytic_bounds_lie_below_the_measurement(train, checkpointing, autocast):
    config = {**resolve_model_configs("embedded").transformer, **TINY_SIZES,
              "axes_dims_rope": list(TINY_SIZES["axes_dims_rope"])}
    shape = CallShape(rows=4, image_tokens=64, text_tokens=8)
    measured = estimate_flux_call(config, shape, train=train, gradient_checkpointing=checkpointing,
                                  precision=CallPrecision(autocast=autocast)).peak
    bound = bound_flux_call(config, shape, train=train, gradient_checkpointing=checkpointing,
                            compute_bytes=2 if autocast else 4).peak
    assert 0.05 * measured < bound <= measured
    vae = resolve_model_configs("embedded").vae
    measured = estimate_vae_decode(vae, 2, 128, 128, torch.float32).peak
    assert 0.05 * measured < bound_vae_decode(vae, 2, 128, 128, 4).peak <= measured


def _refused(command, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run_command(command, "prog")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("prog: error: not enough memory: ")
    return lines[0]


@pytest.mark.parametrize("flags, part, lower", [
    (["--model.height", "100000", "--model.width", "100000"], "activations (sampling call)",
     "model.height x model.width"),
    (["--sampling.group_size", "100000000"], "rollout buffers", "sampling.group_size"),
    (["--sampling.prompts_per_step", "100000000"], "rollout buffers", "sampling.prompts_per_step"),
    (["--model.lora_rank", "1000000000"], "optimizer state", "model.lora_rank"),
    (["--sampling.group_size", "4096", "--sampling.prompts_per_step", "64",
      "--sampling.batch_size", "262144"], "activations (sampling call)", "sampling.batch_size"),
    (["--optim.micro_batch_size", "1000000"], "activations (training call)",
     "optim.micro_batch_size"),
])
def test_train_refuses_what_cannot_fit_before_the_run_directory(tmp_path, monkeypatch, capsys,
                                                                host_has, flags, part, lower):
    from chunk_grpo.train import loop as train

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(train, "build_policy", never)
    out = tmp_path / "run"
    line = _refused(lambda: train_cli.main(["--run.output_dir", str(out), *flags]), capsys)
    assert "and 8.0 GB is available (MemAvailable)" in line
    assert f"its largest part is {part}" in line and lower in line
    assert not out.exists()


def test_the_tiny_run_fits_and_the_bound_counts_the_ranks_of_a_host(tiny_flux, tmp_path,
                                                                    monkeypatch):
    cfg = tiny_config(tiny_flux, tmp_path / "run")
    bounds.check_train_memory(cfg, 1, available=BUDGET)  # megabytes of a few GB: fits
    with pytest.raises(PlanDoesNotFit, match="phase needs at least"):
        bounds.check_train_memory(cfg, 1, available=10**6)
    settings = settings_from_config(cfg, 2, device="cpu", reward_gb=0.0)
    need = build_plan(dataclasses.replace(settings, activations="bound"), 1.0).peak_bytes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 2 processes share this host
    bounds.check_train_memory(cfg, 2, available=int(2.05 * need))
    with pytest.raises(PlanDoesNotFit, match=r"\(each of 2 processes\)"):
        bounds.check_train_memory(cfg, 2, available=int(1.95 * need))


def test_evaluate_refuses_a_huge_image_before_loading_the_model(tmp_path, monkeypatch, capsys,
                                                                host_has):
    from chunk_grpo.cli import evaluate
    from chunk_grpo.models import FluxPolicy

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(FluxPolicy, "from_pretrained", never)
    out = tmp_path / "eval"
    line = _refused(lambda: evaluate.main(["--model.height", "100000", "--model.width", "100000",
                                           "--out", str(out)]), capsys)
    assert "the evaluation at 100000x100000 needs at least" in line
    assert "lower sampling.batch_size, model.height x model.width" in line
    line = _refused(lambda: evaluate.main(["--images-per-prompt", "100000000", "--out",
                                           str(out)]), capsys)
    assert "its largest part is the images kept for scoring" in line
    assert not out.exists()
