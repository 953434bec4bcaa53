"""The client of a reward server (`chunk_grpo.rewards.server`): ``--reward.name
remote:http://HOST:PORT``.

Each call POSTs the images (as 8-bit pixels) and prompts to ``URL/score`` and returns the
server's scores. A connection that cannot be opened within ``connect_timeout``, an answer that
does not come within ``read_timeout``, or a server that is busy (502/503/504) is retried
``retries`` times with exponential backoff; then a `RewardUnavailableError` names the URL and
how to start the server (or, when the server is up but answered 503/504 every time, that it is
busy or its reward timed out). A request the server rejects (4xx) or a reward that failed on the
server (500) is a `RewardOutputError` at once: trying again would give the same answer.
A server started with ``--token-file`` needs its token: the client sends
``Authorization: Bearer TOKEN`` with TOKEN from ``$CHUNK_GRPO_REWARD_TOKEN``, or the first line
of the file ``$CHUNK_GRPO_REWARD_TOKEN_FILE``.
The wire format is documented in `chunk_grpo.rewards.server`; `encode_score_request` and
`decode_score_request` are its two halves.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import torch

from chunk_grpo.config.reward_spec import RewardSpecError
from chunk_grpo.rewards.http_retry import RetriesExhausted, send, split_http_url, with_retries
from chunk_grpo.rewards.outputs import RewardOutputError, RewardUnavailableError
from chunk_grpo.rewards.registry import register_reward

_HEADER_LENGTH = struct.Struct(">I")  # 4-byte big-endian length of the JSON header
_RETRY_STATUSES = (502, 503, 504)
_BUSY_MEANING = {502: "a proxy could not reach it", 503: "it is busy (its --threads and --queue "
                 "are full)", 504: "its reward did not finish within its --score-timeout"}
TOKEN_ENV, TOKEN_FILE_ENV = "CHUNK_GRPO_REWARD_TOKEN", "CHUNK_GRPO_REWARD_TOKEN_FILE"


def read_token_file(path: str, what: str) -> str:
    """The first line of a bearer-token file; ValueError naming ``what`` (the flag or variable
    that gave ``path``) when it cannot be read or is empty."""
    try:
        lines = Path(path).read_text().strip().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{what}: {getattr(err, 'strerror', None) or err}") from None
    if not lines or not lines[0].strip():
        raise ValueError(f"{what} is empty: write the token on its first line")
    return lines[0].strip()


def client_token() -> str | None:
    """The reward server's bearer token from the environment (None: send none)."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token
    path = os.environ.get(TOKEN_FILE_ENV, "")
    if not path:
        return None
    try:
        return read_token_file(path, f"{TOKEN_FILE_ENV}={path}")
    except ValueError as err:
        raise RewardSpecError(str(err)) from None


def encode_score_request(images: torch.Tensor, prompts: list[str]) -> bytes:
    """The body of POST /score: header length, JSON header (shape, prompts), uint8 pixels."""
    if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
        raise ValueError(f"images must be [B, 3, H, W] with B = {len(prompts)} prompts, got "
                         f"{tuple(images.shape)}")
    pixels = (images.detach().float().nan_to_num(0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    header = json.dumps({"shape": list(pixels.shape), "prompts": list(prompts)}).encode()
    return _HEADER_LENGTH.pack(len(header)) + header + pixels.cpu().numpy().tobytes()


def decode_score_request(body: bytes) -> tuple[torch.Tensor, list[str]]:
    """(images float32 [B, 3, H, W] in [0, 1], prompts) of a POST /score body, or ValueError
    naming what is wrong."""
    if len(body) < _HEADER_LENGTH.size:
        raise ValueError("the body is shorter than its 4-byte header length")
    (length,) = _HEADER_LENGTH.unpack_from(body)
    try:
        header = json.loads(body[_HEADER_LENGTH.size:_HEADER_LENGTH.size + length])
        shape, prompts = header["shape"], header["prompts"]
        if not (isinstance(shape, list) and all(type(v) is int for v in shape)):
            raise TypeError(f"shape must be a list of integers, got {str(shape)[:80]}")
        if not isinstance(prompts, list):
            raise TypeError(f"prompts must be a list, got {type(prompts).__name__}")
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise ValueError(f"the JSON header must hold 'shape' and 'prompts': {err}") from None
    if len(shape) != 4 or shape[1] != 3 or shape[0] != len(prompts) or min(shape) < 1:
        raise ValueError(f"shape must be [B, 3, H, W] with B = {len(prompts)} prompts, got "
                         f"{shape}")
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a list of str")
    pixels = body[_HEADER_LENGTH.size + length:]
    if len(pixels) != math.prod(shape):
        raise ValueError(f"expected {math.prod(shape)} pixel bytes for shape {shape}, got "
                         f"{len(pixels)}")
    array = np.frombuffer(pixels, dtype=np.uint8).reshape(shape)
    return torch.from_numpy(array.astype(np.float32) / 255.0), prompts


def parse_server_url(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, base path) of http://HOST:PORT[/path], or RewardSpecError."""
    parts = split_http_url(url)
    if parts is None or parts[2] is None:
        raise RewardSpecError(f"reward server URL {url!r}: write remote:http://HOST:PORT, e.g. "
                              f"remote:http://127.0.0.1:8000 (start the server with python -m "
                              f"chunk_grpo.reward_server --reward.name NAME --port 8000)")
    return parts


@register_reward("remote")
class RemoteReward:
    """Scores by POSTing to a reward server; see the module docstring for timeouts and retries."""

    def __init__(self, url: str | None = None, *, connect_timeout: float = 5.0,
                 read_timeout: float = 120.0, retries: int = 2, backoff: float = 0.5):
        if retries < 0 or connect_timeout <= 0 or read_timeout <= 0 or backoff < 0:
            raise ValueError("retries and backoff must be >= 0, the timeouts > 0")
        self.url = url or ""
        self.scheme, self.host, self.port, self.path = parse_server_url(self.url)
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.retries, self.backoff = retries, backoff
        self.token = client_token()

    def _with_retries(self, method: str, route: str, body: bytes | None = None) -> bytes:
        headers = {"Content-Type": "application/octet-stream"} if body is not None else {}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            status, data = with_retries(
                lambda: send(self.scheme, self.host, self.port, method, self.path + route, body,
                             headers, self.connect_timeout, self.read_timeout),
                retries=self.retries, backoff=self.backoff, retry_statuses=_RETRY_STATUSES)
        except RetriesExhausted as err:
            if err.status is not None:  # up, but busy or timing out every time
                raise RewardUnavailableError(
                    f"reward server {self.url} answered {route} with HTTP {err.status} "
                    f"{err.attempts} times: {_BUSY_MEANING.get(err.status, 'busy')}") from None
            raise RewardUnavailableError(
                f"reward server {self.url} did not answer {route} after {err.attempts} attempts "
                f"(last: {err.last}); start it with `python -m chunk_grpo.reward_server "
                f"--reward.name NAME --host {self.host} --port {self.port}` or fix the URL"
            ) from None
        if status != 200:
            try:
                message = json.loads(data)["error"]
            except (ValueError, KeyError, TypeError):
                message = data[:200].decode(errors="replace")
            raise RewardOutputError(f"reward server {self.url} answered HTTP {status}: {message}")
        return data

    def health(self) -> dict:
        """The server's /health answer: the reward it serves and its request counters."""
        return json.loads(self._with_retries("GET", "/health"))

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        data = self._with_retries("POST", "/score", encode_score_request(images, list(prompts)))
        try:
            scores = json.loads(data)["scores"]
        except (ValueError, KeyError, TypeError):
            raise RewardOutputError(f"reward server {self.url} sent an answer without 'scores': "
                                    f"{data[:200]!r}") from None
        return torch.tensor(scores, dtype=torch.float32)
