"""Serve a reward over HTTP, for reward models that cannot live in the trainer's environment.

    python -m chunk_grpo.reward_server --reward.name NAME --port P [--host 127.0.0.1]
        [--reward.device DEVICE] [--max-batch N] [--token-file PATH] [--threads N] [--queue N]
        [--max-body-mb M] [--read-timeout S] [--score-timeout S]

NAME is any reward spec the trainer takes (a registered name, ``module:name``, or a mix
``a=1.0,b=0.5``); the trainer then uses ``--reward.name remote:http://HOST:P``
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

Bounds (every refusal is JSON ``{"error": ...}`` naming the limit): a body larger than
``--max-body-mb`` is 413 before it is read (411 without a Content-Length); a client that sends
nothing for ``--read-timeout`` seconds, or whose request takes 10 times that in all, is 408; at
most ``--threads`` requests are handled at once and ``--queue`` more wait (the listen backlog is
the same size again), beyond that 503 at once; a request whose reward does not finish within
``--score-timeout`` seconds is 504. With ``--token-file PATH`` every request needs the header
``Authorization: Bearer <the file's first line>`` (401 otherwise); the `remote:` client sends
it from ``$CHUNK_GRPO_REWARD_TOKEN`` or the file ``$CHUNK_GRPO_REWARD_TOKEN_FILE``. A ``--host``
that is not a loopback address gets a warning: anyone who can reach it can use the reward.

Batching: requests are queued; one scoring thread takes the oldest, waits up to
``--batch-wait-ms`` for more of the same image size, and scores up to ``--max-batch`` images in
one reward call; a request larger than that is scored in several calls. The reward is only ever
called from that one thread.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer

import torch

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
    abandoned: bool = False  # its client got 504: not scored if it is still queued


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
            if job is not None and job.abandoned:
                continue
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
            if first.abandoned:
                continue
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


@dataclass(frozen=True)
class Limits:
    """What one request may take (see the module docstring)."""

    max_body: int = 256 << 20  # bytes
    read_timeout: float = 30.0  # seconds without a byte from the client
    score_timeout: float = 600.0  # seconds for the reward (0: no limit)
    token: str | None = None  # the bearer token every request must carry


def make_handler(spec: str, scorer: BatchingScorer, verbose: bool = False,
                 limits: Limits = Limits()):
    """The request handler class of a server scoring with ``scorer``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = limits.read_timeout  # every read of the socket (StreamRequestHandler)

        def _send(self, status: int, payload: dict, close: bool = False) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)

        def _refuse(self, status: int, message: str) -> None:
            """Answer ``status`` and close without reading the body (what little was sent is
            discarded first, so the client reads the answer rather than a reset)."""
            self._send(status, {"error": message}, close=True)
            _discard_and_close(self.connection)

        def _authorised(self) -> bool:
            if limits.token is None:
                return True
            sent = self.headers.get("Authorization", "")
            if hmac.compare_digest(sent.encode(), f"Bearer {limits.token}".encode()):
                return True
            self._refuse(401, "missing or wrong bearer token: the server was started with "
                              "--token-file; give the client the same token "
                              "(CHUNK_GRPO_REWARD_TOKEN or CHUNK_GRPO_REWARD_TOKEN_FILE)")
            return False

        def _content_length(self) -> int | None:
            """The body's size, or None after answering 411/400/413."""
            text = self.headers.get("Content-Length")
            if text is None:
                self._refuse(411, "a Content-Length header is required")
                return None
            try:
                length = int(text)
                if length < 0:
                    raise ValueError
            except ValueError:
                self._refuse(400, f"Content-Length {text[:40]!r} is not a size in bytes")
                return None
            if length > limits.max_body:
                self._refuse(413, f"the body of {length} bytes is larger than the server's "
                                  f"limit of {limits.max_body} bytes (--max-body-mb): send "
                                  "fewer images per request")
                return None
            return length

        def handle_expect_100(self) -> bool:
            # Refuse a body that is too large before the client sends it.
            if self._authorised() and self._content_length() is not None:
                return super().handle_expect_100()
            return False

        def _read_body(self, length: int) -> bytes | None:
            """``length`` bytes, or None after answering 408 to a client too slow to send
            them (no byte for read_timeout seconds, or 10 times that in all)."""
            deadline = time.monotonic() + 10 * limits.read_timeout
            parts, left = [], length
            try:
                while left:
                    part = self.rfile.read(min(left, 1 << 20))
                    if not part:
                        self.close_connection = True
                        return None  # the client went away
                    parts.append(part)
                    left -= len(part)
                    if time.monotonic() > deadline:
                        raise TimeoutError
            except TimeoutError:
                self._refuse(408, f"the body did not arrive in time ({length} bytes, "
                                  f"--read-timeout {limits.read_timeout:g} s)")
                return None
            return b"".join(parts)

        def do_GET(self):  # noqa: N802 (http.server's naming)
            if not self._authorised():
                return None
            if self.path.rstrip("/") != "/health":
                return self._send(404, {"error": f"no route {self.path}; use /health or /score"})
            with scorer.lock:
                counts = dict(scorer.counts)
            return self._send(200, {"reward": spec, "max_batch": scorer.max_batch, **counts})

        def do_POST(self):  # noqa: N802
            if not self._authorised():
                return None
            if self.path.rstrip("/") != "/score":
                return self._refuse(404, f"no route {self.path}; POST to /score")
            length = self._content_length()
            if length is None:
                return None
            body = self._read_body(length)
            if body is None:
                return None
            try:
                images, prompts = decode_score_request(body)
            except ValueError as err:
                return self._send(400, {"error": f"bad /score request: {err}"})
            job = scorer.submit(images, prompts)
            if not job.done.wait(limits.score_timeout or None):
                job.abandoned = True
                return self._send(504, {"error": f"the reward did not finish within "
                                                 f"{limits.score_timeout:g} s (--score-timeout)"})
            if job.error is not None:
                return self._send(500, {"error": job.error})
            return self._send(200, {"scores": job.scores.tolist()})

        def _not_allowed(self):
            self._refuse(405, f"{self.command} is not served: GET /health or POST /score")

        do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed  # noqa: N815

        def log_message(self, format, *args):  # noqa: A002 (the base class's name)
            if verbose:
                super().log_message(format, *args)

    return Handler


def _discard_and_close(sock: socket.socket, limit: int = 1 << 20, seconds: float = 1.0) -> None:
    """Stop sending, read and drop at most ``limit`` bytes for at most ``seconds`` (closing a
    socket with unread data resets it, and the client would lose the answer), then close."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(0.1)
        deadline, dropped = time.monotonic() + seconds, 0
        while dropped < limit and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            dropped += len(chunk)
    except OSError:
        pass


_BUSY_BODY = b'{"error": "the server is busy (--threads, --queue are full): try again"}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


class BoundedHTTPServer(HTTPServer):
    """An HTTP server handling requests on ``threads`` threads with ``queue`` more waiting and
    a listen backlog of threads + queue; a connection beyond that is answered 503 at once."""

    daemon_threads = True

    def __init__(self, address, handler, *, threads: int = 16, queue_size: int = 64):
        self.request_queue_size = threads + queue_size  # listen()'s backlog
        super().__init__(address, handler)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="reward-request")
        self.slots = threading.BoundedSemaphore(threads + queue_size)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                request.sendall(_BUSY)
                _discard_and_close(request, limit=1 << 16, seconds=0.2)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self.pool.submit(self._handle, request, client_address)

    def _handle(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 (a broken connection; keep serving)
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self.slots.release()

    def handle_error(self, request, client_address) -> None:
        pass  # a client that went away is not the server's error

    def server_close(self) -> None:
        super().server_close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def serve(spec: str, host: str = "127.0.0.1", port: int = 0, *, max_batch: int = 32,
          batch_wait: float = 0.005, device: str | None = None, verbose: bool = False,
          threads: int = 16, queue_size: int = 64, limits: Limits = Limits()
          ) -> tuple[BoundedHTTPServer, BatchingScorer]:
    """A started-but-not-serving server for the reward ``spec`` (call serve_forever)."""
    if max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
    if not (math.isfinite(batch_wait) and batch_wait >= 0):
        raise ValueError(f"--batch-wait-ms must be a number >= 0, got {batch_wait * 1000}")
    if threads < 1 or queue_size < 0:
        raise ValueError(f"--threads must be >= 1 and --queue >= 0, got {threads} and "
                         f"{queue_size}")
    if not (limits.max_body > 0 and limits.read_timeout > 0 and limits.score_timeout >= 0):
        raise ValueError("--max-body-mb and --read-timeout must be > 0, --score-timeout >= 0")
    dtype = torch.bfloat16 if device and device.startswith("cuda") else None
    reward = build_reward(spec, device=device or None, dtype=dtype)
    scorer = BatchingScorer(reward, max_batch, batch_wait)
    server = BoundedHTTPServer((host, port), make_handler(spec, scorer, verbose, limits),
                               threads=threads, queue_size=queue_size)
    return server, scorer


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
