"""One writer per run directory: `RunLock` holds `RUN_DIR/.lock` while a run writes there.

The lock is an exclusive `fcntl.flock` on the file, which the kernel drops when its process dies,
so a lock left by a killed run (SIGKILL, a crash, a lost node) is taken over by the next run
without any cleanup. The file records the holder's pid, host and start time, for the message a
second run gets. flock is per host: on a shared network file system two hosts may not see each
other's locks, so the host is also checked when it differs from ours and its pid may be alive.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".lock"


class RunLockedError(RuntimeError):
    """Another live process writes to this run directory."""


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


class RunLock:
    """Context manager: exclusive use of ``run_dir`` (created if needed) by this process."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None
        self.took_over: dict | None = None  # the stale holder's record, if there was one

    def acquire(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunLockedError(self._busy_message(_holder(self.path))) from None
        previous = _holder(self.path)
        host = socket.gethostname()
        if previous.get("host") not in (None, host) and not previous.get("released"):
            # flock may not reach across hosts (NFS): a record from another host that never
            # released is only trusted to be stale once it is old
            if time.time() - previous.get("time", 0) < 60:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                raise RunLockedError(self._busy_message(previous))
        if previous.get("pid") and not previous.get("released"):
            self.took_over = previous
        record = {"pid": os.getpid(), "host": host, "time": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def _busy_message(self, holder: dict) -> str:
        who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
        if holder.get("pid") and holder.get("host") == socket.gethostname():
            who += "" if _pid_alive(int(holder["pid"])) else " (exiting)"
        return (f"run directory {self.path.parent} is in use by another run ({who}); wait for it "
                f"to finish, stop it, or choose another output_dir")

    def release(self) -> None:
        if self._fd is None:
            return
        record = {**_holder(self.path), "released": True}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(record).encode(), 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
