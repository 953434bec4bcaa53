"""Checkpoints: a damaged latest checkpoint (or pointer) falls back to the newest intact one, in
one line; a full disk says so and keeps the previous checkpoint."""

import errno
import json
import os
from collections import namedtuple

import pytest
import torch

from chunk_grpo.train import checkpoint as ckpt
from chunk_grpo.train.checkpoint import (
    CheckpointError,
    DiskFullError,
    checkpoint_problem,
    find_resumable,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

SHARD = "__0_0.distcp"  # DCP's file of a one-process checkpoint


def _two_checkpoints(tmp_path):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"w": torch.full((64,), float(step)), "step": step},
                        keep=2)
    return tmp_path / "checkpoints"


def _damage(root, how):
    latest = root / "step-00000002"
    state = latest / SHARD
    if how == "truncated":
        data = state.read_bytes()
        state.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        state.write_bytes(b"")
    elif how == "random-bytes":
        state.write_bytes(os.urandom(state.stat().st_size))  # same size: only the sha256 tells
    elif how == "no-state":
        state.unlink()
    elif how == "no-manifest-random-bytes":
        (latest / "manifest.json").unlink()
        state.write_bytes(os.urandom(300))
    elif how == "manifest-garbled":
        (latest / "manifest.json").write_text("{not json")
    elif how == "no-latest-pointer":
        (root / "latest").unlink()
        return "step-00000002", "missing or stale"
    elif how == "stale-latest-pointer":
        (root / "latest").write_text("step-00000099\n")
        return "step-00000002", "missing or stale"
    return "step-00000001", "skipped damaged checkpoint(s) step-00000002"


@pytest.mark.parametrize("how", ["truncated", "empty", "random-bytes", "no-state",
                                 "no-manifest-random-bytes", "manifest-garbled",
                                 "no-latest-pointer", "stale-latest-pointer"])
def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, how):
    root = _two_checkpoints(tmp_path)
    expected, message = _damage(root, how)
    lines = []
    found = find_resumable(tmp_path, report=lines.append)
    assert found.name == expected
    assert len(lines) == 1 and message in lines[0] and expected in lines[0]
    state = load_checkpoint(found)  # the intact one loads, with its values
    assert state["step"] == int(expected[-1]) and float(state["w"][0]) == state["step"]


def test_intact_checkpoints_resume_silently_and_match_their_manifest(tmp_path):
    root = _two_checkpoints(tmp_path)
    lines = []
    assert find_resumable(tmp_path, report=lines.append).name == "step-00000002" and not lines
    manifest = json.loads((root / "step-00000002" / "manifest.json").read_text())
    assert manifest["format"] == "dcp" and set(manifest["files"]) == {SHARD, ".metadata"}
    assert manifest["files"][SHARD]["bytes"] == (root / "step-00000002" / SHARD).stat().st_size
    assert checkpoint_problem(root / "step-00000001") is None


def test_no_intact_checkpoint_is_one_clear_error(tmp_path):
    root = _two_checkpoints(tmp_path)
    for step in ("step-00000001", "step-00000002"):
        (root / step / SHARD).write_bytes(b"")
    with pytest.raises(CheckpointError, match="no intact checkpoint .* step-00000002 .*empty"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="checkpoint .*step-00000001 is damaged"):
        load_checkpoint(root / "step-00000001")


Usage = namedtuple("Usage", "total used free")


def test_a_full_disk_is_reported_before_writing_and_keeps_the_previous(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"w": torch.zeros(1000)})
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 100, 100))
    with pytest.raises(DiskFullError, match="no space left on device .* needs about "
                                            r"\d+ bytes, 100 are free; the previous checkpoint "
                                            ".*step-00000001 is kept") as err:
        save_checkpoint(tmp_path, 2, {"w": torch.zeros(1000)})
    assert err.value.errno == errno.ENOSPC
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest",
                                                                           "step-00000001"]


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     RuntimeError("[enforce fail at inline_container.cc:664] . "
                                                  "unexpected pos 88192 vs 88144")])
def test_a_disk_filling_up_mid_write_is_reported(tmp_path, monkeypatch, failure):
    save_checkpoint(tmp_path, 1, {"w": torch.zeros(10)})

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(ckpt.torch, "save", fail)  # DCP serialises every entry with it
    with pytest.raises(DiskFullError, match="no space left on device"):
        save_checkpoint(tmp_path, 2, {"w": torch.zeros(10)})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest",
                                                                           "step-00000001"]
    assert load_checkpoint(tmp_path)["w"].sum() == 0


class _FakeCuda:
    """torch.cuda as a process with ``visible`` GPUs sees it, current device ``current``: the
    CUDA generator states it is given are recorded."""

    def __init__(self, visible: int, current: int):
        self.visible, self.current, self.restored = visible, current, []

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.visible > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.visible)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all",
                            lambda states: pytest.fail("every saved CUDA state was restored"))

        def set_rng_state(state, device="cuda"):
            if not 0 <= int(device) < self.visible:
                raise IndexError(f"device {device} of {self.visible}")
            self.restored.append((int(device), state))
        monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)


@pytest.mark.parametrize("visible,current,restored,note", [
    (1, 0, [0], "8 GPU(s), 1 visible here: device 0's restored"),
    (2, 1, [1], "8 GPU(s), 2 visible here: device 1's restored"),
    (8, 5, [5], None),
    (0, 0, [], "8 GPU(s), none is visible here: not restored"),
])
def test_only_the_current_devices_cuda_rng_state_is_restored(monkeypatch, visible, current,
                                                             restored, note):
    """A checkpoint saved with 8 visible GPUs (8 CUDA generator states) resumes on fewer: only
    the current device's state is set, never an index past the visible devices, and the change
    is one line."""
    state = ckpt.rng_state()
    state["cuda"] = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]
    fake = _FakeCuda(visible, current)
    fake.install(monkeypatch)
    line = ckpt.set_rng_state(state)
    assert [d for d, _ in fake.restored] == restored
    for device, value in fake.restored:
        assert torch.equal(value, state["cuda"][device])
    if note is None:
        assert line is None
    else:
        assert line.startswith("[chunk-grpo] resume: ") and line.endswith(note)


def test_a_device_without_a_saved_cuda_rng_state_keeps_its_own(monkeypatch):
    state = dict(ckpt.rng_state(), cuda=[torch.zeros(16, dtype=torch.uint8)] * 2)
    fake = _FakeCuda(4, 3)
    fake.install(monkeypatch)
    assert ckpt.set_rng_state(state).endswith("2 GPU(s), 4 visible here: device 3 has none and "
                                              "keeps its seeded state")
    assert fake.restored == []


def test_a_checkpoint_without_a_run_state_is_not_resumed(tmp_path):
    from chunk_grpo.train.run_checkpoint import find_run_checkpoint

    _two_checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match="step-00000002 holds no trainer's run state"):
        find_run_checkpoint(tmp_path)
