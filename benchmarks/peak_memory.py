"""Peak memory of a block of benchmark code: the CUDA allocator's peak, or on the CPU the
resident set sampled every 2 ms (a process that ran other work first may reuse freed memory:
measure in a fresh process where it matters)."""

from __future__ import annotations

import os
import threading
import time

import torch


class PeakMemory:
    """Peak memory above the starting level while the block runs, in MiB."""

    def __enter__(self):
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        self.base = self.peak = self._rss()
        self.running = True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _watch(self):
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        if self.cuda:
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.running = False
            self.thread.join()
            self.peak = max(self.peak, self._rss())
        self.mib = (self.peak - self.base) / 2**20
