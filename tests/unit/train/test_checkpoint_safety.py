"""Nothing in a checkpoint runs as code: for every checkpoint kind (a run's state.pt, an ablation
cell's, a sharded run's trainer.pt and DCP's .metadata) a payload whose unpickling would create a
file is refused in one line (exit 2), with its manifest rewritten to match and with it deleted,
and the file is never created. Checkpoint selection: the newest intact one wins over `latest`,
and a damaged sharded checkpoint falls back when the run directory is given."""

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
from parallel_utils import build_transformer, make_optimizer, train
from trainer_utils import Brightness, registered_rewards, tiny_config

from chunk_grpo.analysis.ablate import train_resumably
from chunk_grpo.cli.runner import run_command
from chunk_grpo.cli.train import main
from chunk_grpo.config.parsing import build_config
from chunk_grpo.runtime.parallelize import trainable_parameters
from chunk_grpo.train.checkpoint import (
    CheckpointError,
    find_resumable,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from chunk_grpo.train.loop import run
from chunk_grpo.train.sharded_checkpoint import (
    SHARDS,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
    select_checkpoint,
)

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")


class Payload:
    """Unpickling this creates ``path``: what an attacker's checkpoint would run instead."""

    def __init__(self, path: pathlib.Path):
        self.path = str(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def _rewrite_manifest(checkpoint: pathlib.Path, name: str) -> None:
    """Make the manifest match the tampered file ``name`` (as an attacker would)."""
    manifest_path = checkpoint / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


def _tamper(checkpoint: pathlib.Path, name: str, payload: bytes, manifest: str) -> None:
    (checkpoint / name).write_bytes(payload)
    if manifest == "rewritten":
        _rewrite_manifest(checkpoint, name)
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


def _state_with_payload(marker: pathlib.Path) -> bytes:
    path = marker.with_suffix(".pt")
    torch.save({"model": {"w": torch.zeros(2)}, "rng": Payload(marker)}, path)
    return path.read_bytes()


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
    _tamper(latest_checkpoint(out), "state.pt", _state_with_payload(marker), manifest)
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
    _tamper(latest_checkpoint(cell), "state.pt", _state_with_payload(marker), "rewritten")
    cfg = build_config(cell / "config.yaml", {"run.max_steps": 2})
    line = _one_line_exit_2(lambda: train_resumably(cfg, cell), capsys)
    assert "holds objects other than tensors" in line and not marker.exists()
    shutil.copytree(finished_run, cell, dirs_exist_ok=True)  # the manifest deleted
    _tamper(latest_checkpoint(cell), "state.pt", _state_with_payload(marker), "deleted")
    line = _one_line_exit_2(lambda: train_resumably(cfg, cell), capsys)
    assert "no manifest" in line and not marker.exists()


def test_an_earlier_versions_pickled_rng_state_is_refused_with_what_to_do(tmp_path, capsys):
    save_checkpoint(tmp_path, 1, {"w": torch.ones(2)})
    checkpoint = latest_checkpoint(tmp_path)
    old = {"w": torch.ones(2), "step": 1, "rng": {"torch": torch.get_rng_state(),
                                                  "numpy": np.random.get_state(),
                                                  "python": random.getstate()}}
    torch.save(old, checkpoint / "state.pt")
    _rewrite_manifest(checkpoint, "state.pt")
    line = _one_line_exit_2(lambda: load_checkpoint(tmp_path), capsys)
    assert "numpy" in line and "not written by this version" in line


def test_rng_states_round_trip_exactly_through_a_weights_only_load(tmp_path):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.standard_normal()  # a cached gaussian in numpy's state
    random.gauss(0, 1)
    save_checkpoint(tmp_path, 1, {"w": torch.ones(1)})
    expected = (random.random(), float(np.random.standard_normal()), float(torch.rand(1)))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    state = torch.load(latest_checkpoint(tmp_path) / "state.pt", weights_only=True)
    set_rng_state(state["rng"])
    assert (random.random(), float(np.random.standard_normal()), float(torch.rand(1))) == expected
    assert set(rng_state()) >= {"torch", "numpy", "python"}


# ----------------------------------------------------------------------------- sharded

def _sharded_run(run_dir: pathlib.Path, steps=(1,)) -> torch.nn.Module:
    model = build_transformer(True)
    params = trainable_parameters(model)
    optimizer = make_optimizer(params)
    train(model, params, 0, 1, optimizer=optimizer, steps=range(1))
    for step in steps:
        save_sharded_checkpoint(run_dir, step, model, optimizer, {"n": step, "bad_streak": 0})
    return model


def _load(run_dir: pathlib.Path, trust: bool = False):
    model = build_transformer(True)
    return lambda: load_sharded_checkpoint(run_dir, model,
                                           make_optimizer(trainable_parameters(model)),
                                           trust=trust)


@pytest.mark.parametrize("name", ["trainer.pt", f"{SHARDS}/.metadata"])
@pytest.mark.parametrize("manifest", ["rewritten", "deleted"])
def test_a_sharded_checkpoint_with_a_payload_is_refused_and_nothing_runs(tmp_path, capsys, name,
                                                                          manifest):
    run_dir, marker = tmp_path / "run", tmp_path / "pwned"
    _sharded_run(run_dir)
    payload = (_state_with_payload(marker) if name == "trainer.pt"
               else pickle.dumps(Payload(marker)))
    _tamper(latest_checkpoint(run_dir), name, payload, manifest)
    # torch.save pickles the function as getattr(Path, "touch"), pickle.dumps by its name
    refused = "getattr" if name == "trainer.pt" else "pathlib.Path.touch"
    line = _one_line_exit_2(_load(run_dir), capsys)
    assert ("no manifest" if manifest == "deleted" else refused) in line
    assert not marker.exists()
    if manifest == "deleted":  # trusted: trainer.pt and .metadata are still read restrictedly
        line = _one_line_exit_2(_load(run_dir, trust=True), capsys)
        assert refused in line and not marker.exists()


def test_a_damaged_sharded_checkpoint_falls_back_when_the_run_directory_is_given(tmp_path,
                                                                                 capsys):
    run_dir = tmp_path / "run"
    _sharded_run(run_dir, steps=(1, 2))
    newest = latest_checkpoint(run_dir)
    shard = next((newest / SHARDS).glob("*.distcp"))
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
        save_checkpoint(tmp_path, step, {"w": torch.full((4,), float(step))})
    (tmp_path / "checkpoints" / "latest").write_text("step-00000001\n")  # stale
    lines = []
    assert find_resumable(tmp_path, report=lines.append).name == "step-00000002"
    assert len(lines) == 1 and "names step-00000001, but step-00000002 is newer" in lines[0]
    assert load_checkpoint(tmp_path, restore_rng=False)["step"] == 2


def test_trust_checkpoint_goes_with_resume(capsys):
    with pytest.raises(SystemExit) as stop:
        run_command(lambda: main(["--trust-checkpoint"]), "prog")
    assert stop.value.code == 2 and "--trust-checkpoint goes with --resume" in (
        capsys.readouterr().err)
