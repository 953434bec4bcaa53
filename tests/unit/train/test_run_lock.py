"""One run per directory: a second writer is refused in one line; a killed run's lock is taken
over."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from chunk_grpo.train.run_lock import LOCK_NAME, RunLock, RunLockedError

ROOT = Path(__file__).resolve().parents[3]


def _holder_process(run_dir: Path) -> subprocess.Popen:
    """A separate process that takes the lock and sleeps (a run in progress)."""
    code = textwrap.dedent(f"""
        import sys, time
        from chunk_grpo.train.run_lock import RunLock
        RunLock({str(run_dir)!r}).acquire()
        print("locked", flush=True)
        time.sleep(60)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env,
                            cwd=ROOT, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_is_refused_while_the_first_holds_the_lock(tmp_path):
    holder = _holder_process(tmp_path)
    try:
        with pytest.raises(RunLockedError, match=rf"in use by another run \(pid {holder.pid} on "):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_runs_lock_is_taken_over(tmp_path):
    holder = _holder_process(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = RunLock(tmp_path).acquire()  # the kernel dropped the dead process's flock
    try:
        assert lock.took_over["pid"] == holder.pid
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_release_lets_the_next_run_in_without_a_takeover_note(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(RunLockedError):
            RunLock(tmp_path).acquire()  # flock: even a second handle in this process waits
    lock = RunLock(tmp_path).acquire()
    assert lock.took_over is None
    lock.release()


def test_a_recent_record_from_another_host_is_respected(tmp_path):
    record = {"pid": 1, "host": "some-other-node", "time": time.time()}
    (tmp_path / LOCK_NAME).write_text(json.dumps(record))
    with pytest.raises(RunLockedError, match="pid 1 on some-other-node"):
        RunLock(tmp_path).acquire()
    (tmp_path / LOCK_NAME).write_text(json.dumps({**record, "time": time.time() - 3600}))
    RunLock(tmp_path).acquire().release()  # an old record: stale, taken over
