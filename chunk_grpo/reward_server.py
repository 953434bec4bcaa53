"""Serve a reward over HTTP, for reward models that cannot live in the trainer's environment.

    python -m chunk_grpo.reward_server --reward NAME --port P [--host 127.0.0.1] [--max-batch N]

NAME is any reward spec the trainer takes (a registered name, ``module:name``, or a mix
``a=1.0,b=0.5``); the trainer then uses ``--reward remote:http://HOST:P``
(`chunk_grpo.rewards.remote`). ``--port 0`` picks a free port. The first line on stdout is
``reward server: serving 'NAME' on http://HOST:PORT``.

Protocol (HTTP/1.1, standard library on both sides):

- ``GET /health`` -> 200, JSON ``{"reward": NAME, "max_batch": N, "requests": r, "calls": c,
  "images": i}``: the reward served, and how many score requests, reward calls and images so far.
- ``POST /score``, body = a 4-byte big-endian length L, then L bytes of UTF-8 JSON
  ``{"shape": [B, 3, H, W], "prompts": [B strings]}``, then B*3*H*W bytes: the images as uint8
  pixels, round(255 * x) of x in [0, 1], in [B, 3, H, W] order (NaN sent as 0.5). A batch of 64
  images of 512x512 is 48 MiB (a quarter of float32). Answers 200 with JSON
  ``{"scores": [B numbers]}`` (NaN/Infinity written as JSON's non-standard ``NaN``, which
  Python reads), 400 ``{"error": ...}`` for a malformed request, 500 ``{"error": ...}`` when the
  reward raised or returned a bad output (the message names it), 503 while shutting down.

Batching: requests are queued; one scoring thread takes the oldest, waits up to
``--batch-wait-ms`` for more of the same image size, and scores up to ``--max-batch`` images in
one reward call; a request larger than that is scored in several calls. The reward is only ever
called from that one thread.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from chunk_grpo.reward_spec import RewardSpecError
from chunk_grpo.rewards.mix import RewardMix, build_reward
from chunk_grpo.rewards.outputs import RewardError
from chunk_grpo.rewards.remote import decode_score_request


@dataclass
class _Job:
    images: torch.Tensor
    prompts: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    scores: torch.Tensor | None = None
    error: str | None = None


class BatchingScorer:
    """One thread that scores queued jobs, several jobs of one image size per reward call."""

    def __init__(self, reward: RewardMix, max_batch: int, wait_seconds: float):
        self.reward, self.max_batch, self.wait = reward, max_batch, wait_seconds
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.counts = {"requests": 0, "calls": 0, "images": 0}
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="reward-scorer", daemon=True)
        self.thread.start()

    def submit(self, images: torch.Tensor, prompts: list[str]) -> _Job:
        job = _Job(images, prompts)
        with self.lock:
            self.counts["requests"] += 1
        self.jobs.put(job)
        return job

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=10)

    def _gather(self, first: _Job, held: list[_Job]) -> list[_Job]:
        """``first`` and the jobs that arrive within the wait, up to max_batch images of its
        size; jobs of another size are held for the next call."""
        batch, rows = [first], len(first.prompts)
        deadline = time.monotonic() + self.wait
        while rows < self.max_batch:
            try:
                job = self.jobs.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None:
                self.jobs.put(None)  # let the loop see the stop after this batch
                break
            same = job.images.shape[1:] == first.images.shape[1:]
            if same and rows + len(job.prompts) <= self.max_batch:
                batch.append(job)
                rows += len(job.prompts)
            else:
                held.append(job)
                break
        return batch

    def _score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        parts = []
        for start in range(0, len(prompts), self.max_batch):
            parts.append(self.reward(images[start:start + self.max_batch],
                                     prompts[start:start + self.max_batch]))
            with self.lock:
                self.counts["calls"] += 1
                self.counts["images"] += len(prompts[start:start + self.max_batch])
        return torch.cat(parts)

    def _loop(self) -> None:
        held: list[_Job] = []
        while True:
            first = held.pop(0) if held else self.jobs.get()
            if first is None:
                return
            batch = self._gather(first, held)
            try:
                scores = self._score(torch.cat([j.images for j in batch]),
                                     [p for j in batch for p in j.prompts])
            except RewardError as err:
                for job in batch:
                    job.error = str(err)
            except Exception as err:  # keep serving: the client gets the message
                for job in batch:
                    job.error = f"{type(err).__name__}: {err}"
            else:
                start = 0
                for job in batch:
                    job.scores = scores[start:start + len(job.prompts)]
                    start += len(job.prompts)
            for job in batch:
                job.done.set()


def make_handler(spec: str, scorer: BatchingScorer, verbose: bool = False):
    """The request handler class of a server scoring with ``scorer``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") != "/health":
                return self._send(404, {"error": f"no route {self.path}; use /health or /score"})
            with scorer.lock:
                counts = dict(scorer.counts)
            self._send(200, {"reward": spec, "max_batch": scorer.max_batch, **counts})

        def do_POST(self):  # noqa: N802
            if self.path.rstrip("/") != "/score":
                return self._send(404, {"error": f"no route {self.path}; POST to /score"})
            try:
                length = int(self.headers.get("Content-Length", ""))
                images, prompts = decode_score_request(self.rfile.read(length))
            except ValueError as err:
                return self._send(400, {"error": f"bad /score request: {err}"})
            job = scorer.submit(images, prompts)
            job.done.wait()
            if job.error is not None:
                return self._send(500, {"error": job.error})
            self._send(200, {"scores": job.scores.tolist()})

        def log_message(self, format, *args):  # noqa: A002 (the base class's name)
            if verbose:
                super().log_message(format, *args)

    return Handler


def serve(spec: str, host: str = "127.0.0.1", port: int = 0, *, max_batch: int = 32,
          batch_wait: float = 0.005, device: str | None = None,
          verbose: bool = False) -> tuple[ThreadingHTTPServer, BatchingScorer]:
    """A started-but-not-serving server for the reward ``spec`` (call serve_forever)."""
    if max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
    dtype = torch.bfloat16 if device and device.startswith("cuda") else None
    reward = build_reward(spec, device=device or None, dtype=dtype)
    scorer = BatchingScorer(reward, max_batch, batch_wait)
    server = ThreadingHTTPServer((host, port), make_handler(spec, scorer, verbose))
    server.daemon_threads = True
    return server, scorer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m chunk_grpo.reward_server",
                                description="Serve a registered reward (or a mix) over HTTP.")
    p.add_argument("--reward", required=True, help="reward spec, e.g. shapes or a=1.0,b=0.5")
    p.add_argument("--port", type=int, required=True, help="TCP port (0 = a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--max-batch", type=int, default=32, help="images per reward call")
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long to wait for more requests to batch with the first")
    p.add_argument("--device", default="", help="the reward's device (default: its own)")
    p.add_argument("--verbose", action="store_true", help="log every request")
    args = p.parse_args(argv)
    try:
        server, scorer = serve(args.reward, args.host, args.port, max_batch=args.max_batch,
                               batch_wait=args.batch_wait_ms / 1000, device=args.device,
                               verbose=args.verbose)
    except (RewardSpecError, RewardError, ValueError, OSError) as err:
        sys.stderr.write(f"{p.prog}: error: {err}\n")
        raise SystemExit(2) from None
    host, port = server.server_address[:2]
    print(f"reward server: serving {args.reward!r} on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        scorer.stop()


if __name__ == "__main__":
    main()
