"""A run stopped mid-way and resumed from its checkpoint matches an uninterrupted run exactly
(metrics and weights), and checkpoints are written atomically."""


import pytest
import torch
from trainer_utils import Killed, tiny_config, tiny_model_dir, without_times

from chunk_grpo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from chunk_grpo.metrics import read_metrics
from chunk_grpo.train import run


def test_resume_matches_an_uninterrupted_run(tmp_path):
    model = tiny_model_dir(tmp_path)
    # Several optimizer steps per iteration, warm-up + cosine LR, EMA, a random half of the
    # chunks: every piece of state a resume must restore.
    settings = dict(max_steps=4, checkpoint_every=2, eval_every=2, grad_accum=2,
                    chunk_fraction=0.5, chunks="1,1,2", warmup_steps=2, lr_schedule="cosine",
                    ema_decay=0.5, lr=3e-3)
    straight = run(tiny_config(model, tmp_path / "a", **settings))

    def kill_at_3(step, metrics):
        if step == 3:
            raise Killed  # after step 3 was logged, before its checkpoint

    with pytest.raises(Killed):
        run(tiny_config(model, tmp_path / "b", **settings), on_step_end=kill_at_3)
    assert latest_checkpoint(tmp_path / "b").name == "step-00000002"
    assert len(read_metrics(tmp_path / "b" / "metrics.jsonl")) == 3
    resumed = run(tiny_config(model, tmp_path / "b", **settings), run_dir=tmp_path / "b",
                  resume=True)

    a = without_times(read_metrics(straight / "metrics.jsonl"))
    b = without_times(read_metrics(resumed / "metrics.jsonl"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b
    state_a, state_b = (load_checkpoint(d, restore_rng=False) for d in (straight, resumed))
    assert state_a["step"] == state_b["step"] == 4
    for name, value in state_a["model"].items():
        assert torch.equal(value, state_b["model"][name]), name
    for name, value in state_a["ema"]["shadow"].items():
        assert torch.equal(value, state_b["ema"]["shadow"][name]), name
    assert state_a["scheduler"] == state_b["scheduler"]


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"x": torch.tensor([step])}, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-00000002", "step-00000003"]
    # A write that died half-way leaves a temporary directory that is never picked up.
    (tmp_path / "checkpoints" / ".tmp-step-00000004").mkdir()
    assert latest_checkpoint(tmp_path).name == "step-00000003"
    state = load_checkpoint(tmp_path, restore_rng=False)
    assert state["step"] == 3 and int(state["x"]) == 3
    with pytest.raises(ValueError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nothing")


def test_resume_flag_continues_the_saved_run(tmp_path):
    """`python -m chunk_grpo.train --resume DIR --max-steps N`: the saved config is the base,
    flags override it, and the run carries on from its last checkpoint."""
    from chunk_grpo.config import ConfigError
    from chunk_grpo.train import main

    model = tiny_model_dir(tmp_path)
    first = run(tiny_config(model, tmp_path / "run", max_steps=2, checkpoint_every=1))
    assert latest_checkpoint(first).name == "step-00000002"
    resumed = main(["--resume", str(first), "--max-steps", "3"])
    assert resumed == first
    assert [r["step"] for r in read_metrics(first / "metrics.jsonl")] == [1, 2, 3]
    assert load_checkpoint(first, restore_rng=False)["step"] == 3
    assert "max_steps: 3" in (first / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="no config.yaml"):
        main(["--resume", str(tmp_path / "nowhere")])
