"""Throughput and memory of the `hpsv3` reward with the tiny random Qwen2-VL (tests/hpsv3_tiny.py).

Run: `OMP_NUM_THREADS=1 python benchmarks/bench_reward_hpsv3.py` (a script, not collected by
pytest). Scores 64x64 images (resized to 448x448: 256 image tokens + ~500 text tokens per image,
as HPSv3 does), batch 4, after one warm-up batch. Memory is the process's resident set: before
loading, after loading, and its peak while scoring (Linux VmHWM, reset after loading).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hpsv3_tiny import PROMPTS, save_tiny_hpsv3  # noqa: E402

from chunk_grpo.rewards import get_reward  # noqa: E402


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main(n_images: int = 32, batch_size: int = 4, size: int = 64) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_hpsv3(Path(tmp))  # the reference model is dropped on return
        images = torch.rand(n_images, 3, size, size, generator=torch.Generator().manual_seed(0))
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n_images)]
        rss_before = _status_kib("VmRSS")
        start = time.perf_counter()
        reward = get_reward("hpsv3", model=tmp, batch_size=batch_size)
        load_s = time.perf_counter() - start
        rss_loaded = _status_kib("VmRSS")
        reward(images[:batch_size], prompts[:batch_size])  # warm-up
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
        start = time.perf_counter()
        reward(images, prompts)
        seconds = time.perf_counter() - start
        peak = _status_kib("VmHWM")
    params = sum(p.numel() for p in reward.backbone.parameters())
    params += sum(p.numel() for p in reward.head.parameters())
    print(f"hpsv3 tiny ({params / 1e3:.0f}k parameters, fp32, {torch.get_num_threads()} thread): "
          f"{n_images / seconds:.1f} images/s at {size}x{size}, batch {batch_size}; load "
          f"{load_s:.2f} s; RSS {rss_before / 1024:.0f} MiB before loading, "
          f"+{(rss_loaded - rss_before) / 1024:.0f} MiB loaded, peak while scoring "
          f"+{(peak - rss_before) / 1024:.0f} MiB ({peak / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
