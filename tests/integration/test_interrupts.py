"""A reward that blocks never hangs a run: reward.timeout stops it in one line, and Ctrl-C or
SIGTERM while the reward blocks exits at once (130 / 143) with one line naming the checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer_utils import tiny_config

from chunk_grpo.cli.runner import run_command
from chunk_grpo.rewards.scoring import RewardTimeoutError
from chunk_grpo.train.checkpoint import latest_checkpoint
from chunk_grpo.train.loop import run

ROOT = Path(__file__).resolve().parents[2]
MODULE = '''
import os
import pathlib
import time

from chunk_grpo.rewards import register_reward

CALLS = [0]


@register_reward("blocks")
def blocks():
    """Brightness on the start-up probe (call 1) and step 1 (call 2), then blocks."""
    def score(images, prompts):
        CALLS[0] += 1
        if CALLS[0] > 2:
            pathlib.Path(os.environ.get("BLOCK_MARKER", os.devnull)).touch()
            time.sleep(60)
        return images.float().mean(dim=(1, 2, 3))
    return score
'''


@pytest.fixture
def blocking_reward(tmp_path, monkeypatch):
    (tmp_path / "blocking_reward.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "blocking_reward:blocks"


def test_a_reward_past_its_timeout_stops_the_run_in_one_line(tiny_flux, tmp_path, capsys,
                                                             blocking_reward):
    cfg = tiny_config(tiny_flux, tmp_path / "run", {"reward.name": blocking_reward,
                                                    "reward.timeout": 0.5,
                                                    "run.max_steps": 3,
                                                    "run.checkpoint_every": 1})
    capsys.readouterr()
    start = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        run_command(lambda: run(cfg), "prog", errors=(RewardTimeoutError,))
    assert time.monotonic() - start < 30  # not the reward's 60 s
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and err[-1].startswith("prog: error: reward 'blocking_reward:")
    kept = tmp_path / "run" / "checkpoints" / "step-00000001"
    assert "did not return within 0.5 s (reward.timeout)" in err[-1]
    assert f"the run stopped at step 2, its last checkpoint {kept} is intact" in err[-1]


@pytest.mark.slow  # a real process: start-up and one iteration
@pytest.mark.parametrize("sig, status, what", [(signal.SIGINT, 130, "Ctrl-C"),
                                               (signal.SIGTERM, 143, "SIGTERM")])
def test_a_signal_while_a_reward_blocks_exits_at_once(tiny_flux, tmp_path, sig, status, what):
    (tmp_path / "blocking_reward.py").write_text(MODULE)
    out, marker = tmp_path / "run", tmp_path / "blocking"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)]),
           "OMP_NUM_THREADS": "1", "BLOCK_MARKER": str(marker)}
    args = ["--model.name", str(tiny_flux), "--reward.name", "blocking_reward:blocks",
            "--run.output_dir", str(out), "--sampling.steps", "5", "--sampling.group_size", "4",
            "--sampling.prompts_per_step", "2", "--chunks.spec", "2,2", "--run.max_steps", "5",
            "--run.checkpoint_every", "1", "--eval.hybrid_steps", "0", "--eval.every", "0",
            "--run.progress", "false", "--model.lora_rank", "0", "--model.mixed_precision", "no",
            "--run.max_minutes", "0", "--sampling.sde_window", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "chunk_grpo.train", *args], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert marker.exists(), proc.communicate(timeout=60)
    sent = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 10  # at once, not after the reward's 60 s
    assert proc.returncode == status, err
    ours = [line for line in err.splitlines() if line.startswith("python -m chunk_grpo.train")]
    kept = latest_checkpoint(out)
    assert kept is not None and kept.name == "step-00000001"
    assert ours == [f"python -m chunk_grpo.train: interrupted ({what}); resume from {kept} "
                    f"with --resume {out}"], err
