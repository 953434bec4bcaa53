"""Throughput and memory of every built-in reward on tiny random models of the real architectures
(the ones the reward tests build: CLIP towers of width 32 and 2 layers, 64x64 input, patch 8;
the aesthetic head at its published sizes), scoring 64x64 images.

    OMP_NUM_THREADS=1 python benchmarks/bench_rewards.py
    OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_rewards.py -s

Each reward runs in a fresh process: memory is its peak resident set (sampled every 2 ms from
/proc/self/statm) above the level after the imports and the input batch, while the reward is
built and scores; so it counts the model, its loading and the scoring's activations. (The peak
of getrusage cannot be used: importing transformers peaks higher than a tiny model needs.)
Throughput: batches of 32 images with 8 distinct prompts (a GRPO group shares its prompt),
the fastest of 20 calls after one warm-up call, timed by the CPU time of the scoring thread
(torch runs on that one thread with OMP_NUM_THREADS=1), so other jobs on a shared machine do
not count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

BATCH, IMAGE_SIZE, CALLS = 32, 64, 20

_CHILD = r"""
import json, os, sys, threading, time
import torch
torch.set_num_threads(1)
import transformers  # noqa: F401  imported before the baseline: not the reward's memory
from transformers import CLIPModel  # noqa: F401
from chunk_grpo.rewards import get_reward
from chunk_grpo.shapes.grammar import COLOURS
name, kwargs, batch, size, calls = json.loads(sys.argv[1])
torch.manual_seed(0)
images = torch.rand(batch, 3, size, size)
distinct = [f"a large {c} circle" for c in COLOURS]
distinct += ["a small red square", "a large blue triangle"]
prompts = (distinct * batch)[:batch]
PAGE = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE
peak, done = [rss()], threading.Event()
def sample():
    while not done.is_set():
        peak.append(max(peak[-1], rss()))
        time.sleep(0.002)
before = peak[0]
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
reward = get_reward(name, **kwargs)
reward(images, prompts)  # warm-up
times = []
for _ in range(calls):
    start = time.thread_time()
    scores = reward(images, prompts)
    times.append(time.thread_time() - start)
done.set()
sampler.join()
assert scores.shape == (batch,) and torch.isfinite(scores).all()
print(json.dumps({"images_per_s": batch / min(times),
                  "memory_mib": (max(peak) - before) / 2**20}))
"""


def build_models(root: Path) -> dict[str, dict]:
    """Tiny checkpoints on disk, and the reward options that load them."""
    import torch
    from reward_models_tiny import (
        open_clip_state_dict,
        save_aesthetic_head,
        save_processor,
        save_tiny_clip,
        tiny_clip_model,
    )

    from chunk_grpo.rewards.hpsv2 import HPSV21_FILE

    clip = save_tiny_clip(root / "clip", image_size=IMAGE_SIZE, patch_size=8)
    save_aesthetic_head(clip, input_size=16)
    processor = save_processor(root / "processor", image_size=IMAGE_SIZE)
    model = tiny_clip_model(image_size=IMAGE_SIZE, patch_size=8, hidden_act="gelu")
    torch.save({"state_dict": open_clip_state_dict(model)}, root / HPSV21_FILE)
    return {
        "jpeg_compressibility": {},
        "jpeg_incompressibility": {},
        "clip": {"model": str(clip)},
        "pickscore": {"model": str(clip), "processor": str(processor)},
        "aesthetic": {"model": str(clip)},
        "hpsv2": {"model": str(root / HPSV21_FILE), "processor": str(processor),
                  "heads": [2, 2]},
        "shapes": {},
        "shapes-clip": {},  # the shipped checkpoint itself (0.55M parameters)
    }


def measure(name: str, kwargs: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    args = json.dumps([name, kwargs, BATCH, IMAGE_SIZE, CALLS])
    result = subprocess.run([sys.executable, "-c", _CHILD, args], env=env,
                            capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{name}: {result.stderr.strip().splitlines()[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run() -> list[tuple[str, dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        rewards = build_models(Path(tmp))
        rows = [(name, measure(name, kwargs)) for name, kwargs in rewards.items()]
    print(f"\n{'reward':24s} {'images/s':>10s} {'memory MiB':>11s}   "
          f"({BATCH} images of {IMAGE_SIZE}x{IMAGE_SIZE} per call, 1 thread)")
    for name, row in rows:
        print(f"{name:24s} {row['images_per_s']:10.0f} {row['memory_mib']:11.1f}")
    return rows


def test_reward_throughput():
    for _, row in run():
        assert row["images_per_s"] > 0


if __name__ == "__main__":
    run()
