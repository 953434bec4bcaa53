"""Nothing in a checkpoint runs as code: for every checkpoint (a run's, an ablation cell's, a bare
model's) a value or a DCP `.metadata` whose unpickling would create a file is refused in one line
(exit 2), with its manifest rewritten to match and with it deleted, and the file is never
created. An earlier version's checkpoint is one line saying what to do. Checkpoint selection:
the newest intact one wins over `latest`, and a damaged checkpoint falls back when the run
directory is given."""

from __future__ import annotations

import hashlib
import json
import pathlib
import pickle
import random
import shutil

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from parallel_utils import build_transformer, make_optimizer, train
from trainer_utils import Brightness, registered_rewards, tiny_config

from chunk_grpo.analysis.ablate import train_resumably
from chunk_grpo.cli.runner import run_command
from chunk_grpo.cli.train import main
from chunk_grpo.config.parsing import build_config
from chunk_grpo.runtime.parallelize import trainable_parameters
from chunk_grpo.train.checkpoint import (
    METADATA,
    CheckpointError,
    ModelState,
    OptimizerState,
    find_resumable,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint,
    restore_checkpoint,
    rng_state,
    save_checkpoint,
    select_checkpoint,
    set_rng_state,
)
from chunk_grpo.train.loop import run

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")


class Payload:
    """Unpickling this creates ``path``: what an attacker's checkpoint would run instead."""

    def __init__(self, path: pathlib.Path):
        self.path = str(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def _rewrite_manifest(checkpoint: pathlib.Path) -> None:
    """Make the manifest match the tampered files (as an attacker would)."""
    manifest_path = checkpoint / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"] = {}
    for file in sorted(p for p in checkpoint.iterdir() if p.name != "manifest.json"):
        data = file.read_bytes()
        manifest["files"][file.name] = {"bytes": len(data),
                                        "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


def _tamper(checkpoint: pathlib.Path, marker: pathlib.Path, manifest: str,
            where: str = "value") -> None:
    """Put a payload into ``checkpoint``: as one of its values (rewritten by DCP itself) or as
    its `.metadata`; then rewrite its manifest to match, or delete it."""
    if where == "value":
        state = read_checkpoint(checkpoint)
        state["run"]["payload"] = Payload(marker)
        for file in checkpoint.glob("*.distcp"):
            file.unlink()
        dcp.save(state, checkpoint_id=checkpoint, no_dist=True)
    else:
        (checkpoint / METADATA).write_bytes(pickle.dumps(Payload(marker)))
    if manifest == "rewritten":
        _rewrite_manifest(checkpoint)
    else:
        (checkpoint / "manifest.json").unlink()


def _one_line_exit_2(call, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run_command(call, "prog", errors=(CheckpointError,))
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("prog: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tiny_flux, tmp_path_factory):
    """A finished one-process run with a checkpoint at step 1."""
    root = tmp_path_factory.mktemp("safety")
    with registered_rewards(test_brightness=Brightness):
        return run(tiny_config(tiny_flux, root / "run", {"run.max_steps": 1,
                                                         "run.checkpoint_every": 1}))


@pytest.mark.parametrize("manifest", ["rewritten", "deleted"])
def test_a_run_checkpoint_with_a_payload_is_refused_and_nothing_runs(finished_run, tmp_path,
                                                                      capsys, manifest):
    out, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(finished_run, out)
    _tamper(latest_checkpoint(out), marker, manifest)
    line = _one_line_exit_2(lambda: main(["--resume", str(out), "--run.max_steps", "2"]), capsys)
    expected = "holds objects other than tensors" if manifest == "rewritten" else "no manifest"
    assert expected in line and not marker.exists()
    if manifest == "deleted":  # trusted: still read as tensors and plain values only
        line = _one_line_exit_2(lambda: main(["--resume", str(out), "--run.max_steps", "2",
                                              "--trust-checkpoint"]), capsys)
        assert "plain values (e.g. getattr)" in line and not marker.exists()


def test_an_ablation_cell_checkpoint_with_a_payload_is_refused(finished_run, tmp_path, capsys):
    cell, marker = tmp_path / "cells" / "step-s0", tmp_path / "pwned"
    shutil.copytree(finished_run, cell)
    _tamper(latest_checkpoint(cell), marker, "rewritten")
    cfg = build_config(cell / "config.yaml", {"run.max_steps": 2})
    line = _one_line_exit_2(lambda: train_resumably(cfg, cell), capsys)
    assert "holds objects other than tensors" in line and not marker.exists()
    shutil.copytree(finished_run, cell, dirs_exist_ok=True)  # the manifest deleted
    _tamper(latest_checkpoint(cell), marker, "deleted")
    line = _one_line_exit_2(lambda: train_resumably(cfg, cell), capsys)
    assert "no manifest" in line and not marker.exists()


@pytest.mark.parametrize("old", ["state.pt", "trainer.pt"])
def test_an_earlier_versions_checkpoint_is_one_line_saying_what_to_do(finished_run, tmp_path,
                                                                       capsys, old):
    """A run whose checkpoint an earlier chunk-grpo wrote (one torch.save file, or trainer.pt
    beside DCP shards): resuming it names the checkpoint and the two ways on, and reads
    nothing."""
    out, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(finished_run, out)
    checkpoint = latest_checkpoint(out)
    shutil.rmtree(checkpoint)
    checkpoint.mkdir()
    torch.save({"model": {"w": torch.zeros(2)}, "rng": Payload(marker)}, checkpoint / old)
    (checkpoint / "manifest.json").write_text(json.dumps({"step": 1, "files": {}}))
    line = _one_line_exit_2(lambda: main(["--resume", str(out), "--run.max_steps", "2"]), capsys)
    assert f"{checkpoint} was written by an earlier chunk-grpo" in line
    assert "resume it with the chunk-grpo version that wrote it, or start a new run" in line
    assert not marker.exists()
    line = _one_line_exit_2(lambda: load_checkpoint(checkpoint), capsys)
    assert "earlier chunk-grpo" in line


def test_rng_states_round_trip_exactly(tmp_path):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.standard_normal()  # a cached gaussian in numpy's state
    random.gauss(0, 1)
    save_checkpoint(tmp_path, 1, {"run": {"rng": rng_state()}})
    expected = (random.random(), float(np.random.standard_normal()), float(torch.rand(1)))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(load_checkpoint(tmp_path)["run"]["rng"])
    assert (random.random(), float(np.random.standard_normal()), float(torch.rand(1))) == expected
    assert set(rng_state()) >= {"torch", "numpy", "python"}


# ----------------------------------------------------------------------------- sharded

def _model_run(run_dir: pathlib.Path, steps=(1,)) -> torch.nn.Module:
    model = build_transformer(True)
    params = trainable_parameters(model)
    optimizer = make_optimizer(params)
    train(model, params, 0, 1, optimizer=optimizer, steps=range(1))
    for step in steps:
        save_checkpoint(run_dir, step, {"model": ModelState(model),
                                        "optimizer": OptimizerState(model, optimizer),
                                        "run": {"n": step, "bad_streak": 0}})
    return model


def _load(run_dir: pathlib.Path, trust: bool = False):
    """Select, read the run state and load a fresh model and optimizer, as a resume does."""
    model = build_transformer(True)
    optimizer = make_optimizer(trainable_parameters(model))

    def load():
        path = select_checkpoint(run_dir, trust=trust)
        state = read_checkpoint(path, ("run",))["run"]
        restore_checkpoint(path, {"model": ModelState(model),
                                  "optimizer": OptimizerState(model, optimizer)})
        return state
    return load


@pytest.mark.parametrize("where", ["value", METADATA])
@pytest.mark.parametrize("manifest", ["rewritten", "deleted"])
def test_a_checkpoint_with_a_payload_is_refused_and_nothing_runs(tmp_path, capsys, where,
                                                                  manifest):
    run_dir, marker = tmp_path / "run", tmp_path / "pwned"
    _model_run(run_dir)
    _tamper(latest_checkpoint(run_dir), marker, manifest, where)
    # torch.save pickles the function as getattr(Path, "touch"), pickle.dumps by its name
    refused = "getattr" if where == "value" else "pathlib.Path.touch"
    line = _one_line_exit_2(_load(run_dir), capsys)
    assert ("no manifest" if manifest == "deleted" else refused) in line
    assert not marker.exists()
    if manifest == "deleted":  # trusted: the values and .metadata are still read restrictedly
        line = _one_line_exit_2(_load(run_dir, trust=True), capsys)
        assert refused in line and not marker.exists()


def test_a_damaged_checkpoint_falls_back_when_the_run_directory_is_given(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _model_run(run_dir, steps=(1, 2))
    newest = latest_checkpoint(run_dir)
    shard = next(newest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the sha256 sees it
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert select_checkpoint(run_dir).name == "step-00000001"
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and "skipped damaged checkpoint(s) step-00000002" in printed[0]
    assert _load(run_dir)()["n"] == 1
    line = _one_line_exit_2(_load(newest), capsys)  # this one named: no fallback, say how
    assert "is damaged" in line and "give its run directory" in line


# ----------------------------------------------------------------------------- selection

def test_the_newest_intact_checkpoint_wins_over_an_older_latest(tmp_path):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"w": torch.full((4,), float(step)), "step": step})
    (tmp_path / "checkpoints" / "latest").write_text("step-00000001\n")  # stale
    lines = []
    assert find_resumable(tmp_path, report=lines.append).name == "step-00000002"
    assert len(lines) == 1 and "names step-00000001, but step-00000002 is newer" in lines[0]
    assert load_checkpoint(tmp_path)["step"] == 2


def test_trust_checkpoint_goes_with_resume(capsys):
    with pytest.raises(SystemExit) as stop:
        run_command(lambda: main(["--trust-checkpoint"]), "prog")
    assert stop.value.code == 2 and "--trust-checkpoint goes with --resume" in (
        capsys.readouterr().err)
