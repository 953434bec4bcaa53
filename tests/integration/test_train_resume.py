"""A run stopped mid-way and resumed from its checkpoint matches an uninterrupted run exactly
(metrics and weights), and checkpoints are written atomically."""


import json

import pytest
import torch
from trainer_utils import Killed, tiny_config, without_times

from chunk_grpo.config.schema import PATHS
from chunk_grpo.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from chunk_grpo.train.loop import run
from chunk_grpo.train.metrics import read_metrics

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")


def _straight_and_resumed(model, tmp_path, overrides: dict) -> None:
    """An uninterrupted 4-step run and one killed after step 3 (checkpoint at 2) then resumed
    give the same metrics (without times), weights, EMA and schedule, bit for bit."""
    straight = run(tiny_config(model, tmp_path / "a", overrides))

    def kill_at_3(step, metrics):
        if step == 3:
            raise Killed  # after step 3 was logged, before its checkpoint

    with pytest.raises(Killed):
        run(tiny_config(model, tmp_path / "b", overrides), on_step_end=kill_at_3)
    assert latest_checkpoint(tmp_path / "b").name == "step-00000002"
    assert len(read_metrics(tmp_path / "b" / "metrics.jsonl")) == 3
    resumed = run(tiny_config(model, tmp_path / "b", overrides), run_dir=tmp_path / "b",
                  resume=True)

    a = without_times(read_metrics(straight / "metrics.jsonl"))
    b = without_times(read_metrics(resumed / "metrics.jsonl"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b
    state_a, state_b = (load_checkpoint(d) for d in (straight, resumed))
    assert state_a["run"]["step"] == state_b["run"]["step"] == 4
    for name, value in state_a["model"].items():
        assert torch.equal(value, state_b["model"][name]), name
    for name, value in state_a["ema"]["shadow"].items():
        assert torch.equal(value, state_b["ema"]["shadow"][name]), name
    assert state_a["run"]["scheduler"] == state_b["run"]["scheduler"]
    assert state_a["optimizer"]["state"].keys() == state_a["model"].keys()
    assert _same(state_a["optimizer"], state_b["optimizer"])


def _same(a, b) -> bool:
    """Nested dicts and lists of tensors and plain values, equal bit for bit."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


# Several optimizer steps per iteration, warm-up + cosine LR, EMA, a random half of the chunks:
# every piece of state a resume must restore.
RESUMED = {"run.max_steps": 4, "run.checkpoint_every": 2, "eval.every": 2, "optim.grad_accum": 2,
           "chunks.fraction": 0.5, "optim.warmup_steps": 2, "optim.schedule": "cosine",
           "optim.ema_decay": 0.5, "optim.lr": 3e-3}


def test_resume_matches_an_uninterrupted_run(tiny_flux, tmp_path):
    _straight_and_resumed(tiny_flux, tmp_path, overrides={"chunks.spec": "1,1,2", **RESUMED})


def test_adamw8bit_lora_resume_matches_an_uninterrupted_run(tiny_flux, tmp_path):
    """bitsandbytes' 8-bit AdamW keeps nested, partly non-tensor state: it round-trips too."""
    _straight_and_resumed(tiny_flux, tmp_path, overrides={"chunks.spec": "1,1,2",
                                                          "optim.name": "adamw8bit",
                                                          "model.lora_rank": 4, **RESUMED})


def test_bf16_resume_matches_an_uninterrupted_run(tiny_flux, tmp_path):
    """bf16 autocast with LoRA and the auto chunk layout: the uninterrupted run measures the
    temporal profile (a sampling pass of its own) before step 1, the resumed one reads the
    layout from its checkpoint, so the first transformer call under autocast differs. What
    either run caches at its first call (the unconditional prompt's embedding) must not depend
    on which call that was (true CFG: every call also runs the unconditional prompt)."""
    _straight_and_resumed(tiny_flux, tmp_path, overrides={"chunks.spec": "auto",
                                                          "model.mixed_precision": "bf16",
                                                          "model.lora_rank": 4,
                                                          "sampling.cfg_scale": 3.0,
                                                          **RESUMED})


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"x": torch.tensor([step]), "step": step}, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-00000002", "step-00000003"]
    # A write that died half-way leaves a temporary directory that is never picked up.
    (tmp_path / "checkpoints" / ".tmp-step-00000004").mkdir()
    assert latest_checkpoint(tmp_path).name == "step-00000003"
    state = load_checkpoint(tmp_path)
    assert state["step"] == 3 and int(state["x"]) == 3
    with pytest.raises(ValueError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nothing")


def test_ctrl_c_while_a_checkpoint_is_written_keeps_the_previous_one(tmp_path, monkeypatch):
    """Ctrl-C inside DCP's writer is the KeyboardInterrupt itself (which the run turns into its
    exit 130 naming a checkpoint), not DCP's wrapper; the half-written step is never published."""
    from torch.distributed.checkpoint import filesystem

    save_checkpoint(tmp_path, 1, {"x": torch.tensor([1]), "step": 1})

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(filesystem, "_write_item", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, {"x": torch.tensor([2]), "step": 2})
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    assert int(load_checkpoint(tmp_path)["x"]) == 1


def test_resume_flag_continues_the_saved_run(tiny_flux, tmp_path):
    """`python -m chunk_grpo.train --resume DIR --max-steps N`: the saved config is the base,
    flags override it, and the run carries on from its last checkpoint."""
    from chunk_grpo.cli.train import main
    from chunk_grpo.config.errors import ConfigError

    model = tiny_flux
    first = run(tiny_config(model, tmp_path / "run", {"run.max_steps": 2,
                                                      "run.checkpoint_every": 1}))
    assert latest_checkpoint(first).name == "step-00000002"
    resumed = main(["--resume", str(first), "--run.max_steps", "3"])
    assert resumed == first
    assert [r["step"] for r in read_metrics(first / "metrics.jsonl")] == [1, 2, 3]
    assert load_checkpoint(first)["run"]["step"] == 3
    assert "max_steps: 3" in (first / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="no config.yaml"):
        main(["--resume", str(tmp_path / "nowhere")])


# ----------------------------------------------------------------------------- finished runs

def _files(run_dir):
    """Every file of a run directory with its bytes and mtime (what a no-op must not touch)."""
    return {str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}


FINISHING = {"run.max_steps": 2, "run.checkpoint_every": 1, "eval.hybrid_steps": 2}


def test_resuming_a_finished_run_changes_nothing_unless_max_steps_is_raised(tiny_flux, tmp_path,
                                                                            capsys):
    from chunk_grpo.cli.runner import run_command
    from chunk_grpo.cli.train import main

    out = run(tiny_config(tiny_flux, tmp_path / "run", FINISHING))
    summary = (out / "summary.txt").read_text()
    assert "updates   2 optimizer steps, 0 skipped" in summary  # one per iteration
    assert set(json.loads((out / "summary.json").read_text())) == {
        "eval", "eval_hybrid", "chunks", "stopped"}
    before = _files(out)
    capsys.readouterr()
    assert main(["--resume", str(out)]) == out
    assert f"{out} finished at step 2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        run_command(lambda: main(["--resume", str(out), "--run.max_steps", "1"]), "prog")
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and err[-1].startswith("prog: error: ")
    assert "is at step 2, beyond run.max_steps 1: nothing to train and nothing changed" in err[-1]
    assert _files(out) == before
    main(["--resume", str(out), "--run.max_steps", "3"])  # raised: trains on, a new summary
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    # the chunks trained are counted over the whole run, across the resume
    chunks = json.loads((out / "summary.json").read_text())["chunks"]
    assert chunks["iterations"] == 3 and chunks["trained"] == [
        sum(r["chunks_trained"] == str(j) for r in records) for j in range(2)]
    assert sum(chunks["trained"]) == 3  # chunks 2,2 at fraction 0.5: one per iteration
    assert json.loads((out / "finished.json").read_text()) == {
        "step": 3, "summary": True, "final_model": True}


def test_max_steps_0_on_a_fresh_run_is_refused_before_the_run_directory(tiny_flux, tmp_path):
    from chunk_grpo.config.errors import ConfigError

    with pytest.raises(ConfigError, match="max_steps is 0"):
        run(tiny_config(tiny_flux, tmp_path / "run", {"run.max_steps": 0}))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("killed_in", ["export_final", "finish_summary"])
def test_a_kill_while_finishing_keeps_the_comparison(tiny_flux, tmp_path, monkeypatch, killed_in):
    """Killed during the export the summary is kept; killed before it, the resume redoes the
    final evaluation and writes the same comparison the run logged."""
    import chunk_grpo.train.run_eval as trainer_eval

    def killed(*args, **kwargs):
        raise Killed

    cfg = tiny_config(tiny_flux, tmp_path / "run", FINISHING)
    monkeypatch.setattr(trainer_eval, killed_in, killed)
    with pytest.raises(Killed):
        run(cfg)
    monkeypatch.undo()
    out = tmp_path / "run"
    assert not (out / "final_model").exists()
    kept = (out / "summary.json").read_text() if killed_in == "export_final" else None
    assert (kept is not None) == (killed_in == "export_final")
    run(cfg, run_dir=out, resume=True)  # trains nothing: finishes what was missing
    summary = json.loads((out / "summary.json").read_text())
    if kept is not None:
        assert (out / "summary.json").read_text() == kept
    logged = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in logged] == [1, 2]
    assert summary["eval"]["after"] == pytest.approx(logged[-1]["eval/reward_mean"], rel=1e-6)
    assert summary["eval"]["gain"] == pytest.approx(logged[-1]["eval/gain_vs_base"], rel=1e-6)
    assert (out / "final_model" / "model_index.json").is_file()
    assert json.loads((out / "finished.json").read_text())["final_model"] is True


def test_a_run_diverging_at_once_fails_with_the_cause(tiny_flux, tmp_path):
    """--eta 1e6: the rollouts (so the rewards) and the loss are NaN from the first step."""
    from chunk_grpo.train.loop import NothingTrained

    cfg = tiny_config(tiny_flux, tmp_path / "run", {"run.max_steps": 1, "sampling.eta": 1e6})
    with pytest.raises(NothingTrained, match=r"no optimizer step in 1 iteration\(s\): the "
                                             r"(rewards|loss or gradient) were NaN/Inf"):
        run(cfg)
    assert not (tmp_path / "run" / "final_model").exists()
    assert not (tmp_path / "run" / "summary.json").exists()


def test_keys_that_cannot_change_on_resume_are_refused_in_one_line(tiny_flux, tmp_path, capsys):
    from chunk_grpo.cli.runner import run_command
    from chunk_grpo.cli.train import main

    out = run(tiny_config(tiny_flux, tmp_path / "run", {"run.max_steps": 1,
                                                        "run.checkpoint_every": 1}))
    before = _files(out)

    def refused(*flags) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            run_command(lambda: main(["--resume", str(out), "--run.max_steps", "2", *flags]),
                        "prog")
        lines = [line for line in capsys.readouterr().err.splitlines() if "prog:" in line]
        assert stop.value.code == 2 and len(lines) == 1
        return lines[0]

    line = refused("--model.lora_rank", "2", "--chunks.spec", "1,3")
    assert ("cannot change on resume (model.lora_rank 0 -> 2; chunks.spec '2,2' -> '1,3')"
            in line)
    assert _files(out) == before
    (out / "config.yaml").write_text("")
    assert "its config.yaml is empty" in refused()


def test_settings_changed_on_resume_are_applied_and_listed(tiny_flux, tmp_path, capsys):
    from chunk_grpo.cli.train import main

    out = run(tiny_config(tiny_flux, tmp_path / "run", {"run.max_steps": 2,
                                                        "run.checkpoint_every": 1,
                                                        "optim.lr": 1e-3}))
    capsys.readouterr()
    main(["--resume", str(out), "--run.max_steps", "3", "--optim.lr", "5e-4",
          "--optim.weight_decay", "0.1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "changed settings" in line]
    assert lines == ["[chunk-grpo] resuming with changed settings: optim.lr 0.001 -> 0.0005, "
                     "optim.weight_decay 0.0 -> 0.1, run.max_steps 2 -> 3"]
    assert read_metrics(out / "metrics.jsonl")[-1]["lr"] == 5e-4  # the optimizer's, not 1e-3
    group = load_checkpoint(out)["optimizer"]["param_groups"][0]
    assert (group["lr"], group["weight_decay"]) == (5e-4, 0.1)


# ----------------------------------------------------------------------------- every key

def _another_value(path: str, value):
    """A value of ``path`` other than ``value`` (of the field's type; not necessarily valid)."""
    from chunk_grpo.config.checks import field_types, literal_choices
    from chunk_grpo.config.schema import SECTIONS

    section, key = path.split(".")
    hint = field_types(SECTIONS[section])[key]
    choices = literal_choices(hint)
    if choices:
        return next(choice for choice in choices if choice != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, list):
        return [*value, "to_q"]
    if isinstance(value, str):
        return value + "-other"
    return 1.0 if "float" in str(hint) else 1  # None


def test_every_config_key_is_classified_for_resume():
    from chunk_grpo.train.run_checkpoint import (
        APPLIED_ON_RESUME,
        FIXED_ON_RESUME,
        OPTIMIZER_ON_RESUME,
        PER_RANK_ON_RESUME,
    )

    groups = [*FIXED_ON_RESUME, *PER_RANK_ON_RESUME, *OPTIMIZER_ON_RESUME, *APPLIED_ON_RESUME]
    assert sorted(groups) == sorted(PATHS), "classify every key once in run_checkpoint.py"


@pytest.mark.parametrize("path", PATHS)
def test_each_key_changed_on_resume_is_refused_or_applied_and_listed(path):
    """Every key given another value on resume: a fixed one is refused naming it, any other
    (but the per-rank batch, which `config_for_world` reports) is listed in the one line, and
    the optimizer's keys reach the restored optimizer."""
    from pathlib import Path
    from types import SimpleNamespace

    from chunk_grpo.config.errors import ConfigError
    from chunk_grpo.config.schema import TrainConfig
    from chunk_grpo.train.optim import build_lr_scheduler
    from chunk_grpo.train.run_checkpoint import (
        FIXED_ON_RESUME,
        OPTIMIZER_ON_RESUME,
        PER_RANK_ON_RESUME,
        Resume,
        apply_resume_changes,
        check_fixed_keys,
    )

    saved, cfg = TrainConfig(), TrainConfig()
    section, key = path.split(".")  # assigned, not checked: the value need not be valid
    setattr(getattr(cfg, section), key, _another_value(path, saved.get(path)))
    assert cfg.get(path) != saved.get(path)
    resume = Resume(path=Path("run/checkpoints/step-00000001"), step=1, bad_streak=0,
                    layout=(1,), chunk_weights=None, state={"config": saved.to_dict()})
    if path in FIXED_ON_RESUME:
        with pytest.raises(ConfigError, match=f"cannot change on resume \\({path} "):
            check_fixed_keys(cfg, resume)
        return
    check_fixed_keys(cfg, resume)
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight], lr=saved.optim.lr)
    scheduler = build_lr_scheduler(optimizer, warmup_steps=0, total_steps=10, kind="constant")
    tr = SimpleNamespace(cfg=cfg, optimizer=optimizer, scheduler=scheduler, ema=None)
    line = apply_resume_changes(tr, resume)
    if path in PER_RANK_ON_RESUME:
        assert line is None
        return
    assert line == (f"[chunk-grpo] resuming with changed settings: {path} "
                    f"{saved.get(path)!r} -> {cfg.get(path)!r}")
    if path in OPTIMIZER_ON_RESUME and path.startswith("optim.") and path != "optim.ema_decay":
        group = optimizer.param_groups[0]
        values = {"optim.lr": group["initial_lr"], "optim.weight_decay": group["weight_decay"],
                  "optim.beta1": group["betas"][0], "optim.beta2": group["betas"][1],
                  "optim.eps": group["eps"]}
        if path in values:
            assert values[path] == cfg.get(path)
