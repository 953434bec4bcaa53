"""The trainer on 2 gloo ranks (torchrun, CPU) against one process with the same global batch:
FSDP2 and DDP give the same images, the same rewards and, within float reduction order, the same
weights; a 2-rank sharded checkpoint resumes on 1 process and on 2 ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_utils import tiny_config

from chunk_grpo.config.parsing import save_config
from chunk_grpo.train.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow  # each torchrun job starts 2 Python processes

# The weights after 2 AdamW steps from the same gradients up to float reduction order. Adam's
# update lr * m / (sqrt(v) + eps) flips with the rounding of a gradient element near 0 when eps
# is tiny; with eps 1e-3 (above these gradients) it is smooth in the gradient, so rounding stays
# rounding. A wrong average across ranks (e.g. a missing 1/world) would move weights by ~1e-3.
WEIGHT_ATOL = 1e-5


def _config(model: Path, out: Path, overrides: dict):
    settings = {"reward.name": "jpeg_compressibility", "run.max_steps": 2,
                "run.checkpoint_every": 1, "optim.lr": 1e-2, "optim.eps": 1e-3}
    return tiny_config(model, out, {**settings, **overrides})


def _train(ranks: int, *flags: str) -> str:
    """`python -m chunk_grpo.train` on one process or under torchrun on ``ranks`` gloo ranks;
    returns its stdout. Every process runs 1 thread: the thread count changes the float
    reduction order of the model's matmuls, and the rewards compared here would see it."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                str(ranks)] if ranks > 1 else []
    cmd = [sys.executable, *launcher, "-m", "chunk_grpo.train", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((run_dir / "final_model" / "transformer").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(ours: Path, reference: Path) -> None:
    a, b = _metrics(ours), _metrics(reference)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    # Step 1 samples with the initial weights: the same images on 1 rank and 2.
    assert a[0]["reward_mean"] == pytest.approx(b[0]["reward_mean"], abs=1e-6)
    # the guard (the shapes checks) of those images, gathered from the ranks
    assert a[0]["guard/shapes_mean"] == pytest.approx(b[0]["guard/shapes_mean"], abs=1e-6)
    assert a[0]["grad_norm"] == pytest.approx(b[0]["grad_norm"], rel=1e-4)
    assert a[0]["optimizer_steps"] == b[0]["optimizer_steps"] == 1
    wa, wb = _weights(ours), _weights(reference)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key].float(), wb[key].float(), atol=WEIGHT_ATOL, rtol=0)


@pytest.fixture(scope="module")
def setup(tiny_flux, tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    model = tiny_flux
    save_config(_config(model, root / "one", overrides={"sampling.prompts_per_step": 4}),
                root / "one.yaml")
    _train(1, "--config", str(root / "one.yaml"))  # 16 rows, 1 process
    return root, model, root / "one"


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_two_ranks_train_what_one_process_trains(setup, mode):
    root, model, reference = setup
    config_file = root / f"{mode}.yaml"
    save_config(_config(model, root / mode, overrides={"sampling.prompts_per_step": 2,
                                                       "parallel.mode": mode}), config_file)
    _train(2, "--config", str(config_file))
    _assert_same_run(root / mode, reference)
    # its checkpoints are sharded: one DCP file per rank, nothing gathered on rank 0
    latest = root / mode / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in latest.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_a_two_rank_checkpoint_resumes_on_one_process_and_on_two(setup):
    root, model, reference = setup
    config_file = root / "stop.yaml"
    save_config(_config(model, root / "stop", overrides={"sampling.prompts_per_step": 2,
                                                         "parallel.mode": "fsdp",
                                                         "run.max_steps": 1}), config_file)
    _train(2, "--config", str(config_file))
    for where in ("one", "two"):
        resumed = root / f"resumed-{where}"
        subprocess.run(["cp", "-r", str(root / "stop"), str(resumed)], check=True)
        out = _train(1 if where == "one" else 2, "--resume", str(resumed), "--run.max_steps", "2")
        if where == "one":
            assert "resuming a 2-rank checkpoint on 1 rank(s)" in out
        wa, wb = _weights(resumed), _weights(reference)
        for key in wa:
            torch.testing.assert_close(wa[key].float(), wb[key].float(), atol=WEIGHT_ATOL,
                                       rtol=0)
        assert [r["step"] for r in _metrics(resumed)] == [1, 2]


def test_reference_kl_under_fsdp_full_fine_tuning(setup):
    """The KL reference of a fully fine-tuned FSDP run is the base sharded as the policy is,
    filled from the policy's own shards: iteration 1 is exactly on the base (k3 = 0), the next
    has moved away from it."""
    root, model, _ = setup
    config_file = root / "kl.yaml"
    save_config(_config(model, root / "kl", overrides={"sampling.prompts_per_step": 2,
                                                       "parallel.mode": "fsdp",
                                                       "loss.kl_ref": "reference",
                                                       "loss.kl_coef": 1.0,
                                                       "run.checkpoint_every": 0}), config_file)
    _train(2, "--config", str(config_file))
    records = _metrics(root / "kl")
    assert [r["ref_kl"] for r in records][:1] == [0.0] and records[1]["ref_kl"] > 0


def test_the_ema_and_every_ranks_generators_resume_at_another_world_size(setup):
    """A 2-rank FSDP checkpoint holds the EMA's averages (sharded like the weights) and each
    rank's random generators under its own name; resumed on one process, the next EMA update
    starts from the saved averages."""
    root, model, _ = setup
    config_file = root / "ema.yaml"
    save_config(_config(model, root / "ema", overrides={"sampling.prompts_per_step": 2,
                                                        "parallel.mode": "fsdp",
                                                        "run.max_steps": 1,
                                                        "optim.ema_decay": 0.5}), config_file)
    _train(2, "--config", str(config_file))
    first = load_checkpoint(root / "ema")
    assert first["ema"]["shadow"].keys() == first["model"].keys()
    assert sorted(first["run"]["rng"]) == ["rank0", "rank1"]
    _train(1, "--resume", str(root / "ema"), "--run.max_steps", "2")
    second = load_checkpoint(root / "ema")
    assert (second["run"]["step"], second["run"]["world_size"]) == (2, 1)
    for name, average in first["ema"]["shadow"].items():
        expected = average.lerp(second["model"][name].float(), 0.5)
        torch.testing.assert_close(second["ema"]["shadow"][name], expected, rtol=0, atol=1e-7)
