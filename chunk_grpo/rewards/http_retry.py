"""One HTTP request with separate connect and read timeouts, and retries with exponential backoff:
the transport of the reward clients (`chunk_grpo.rewards.remote`, `chunk_grpo.rewards.judge`).

Standard library only (``http.client``): the trainer's environment needs no HTTP package.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Callable
from urllib.parse import urlsplit


class RetriesExhausted(Exception):
    """Every attempt failed to connect, timed out or got a retryable status; ``last`` says how
    the last one failed, ``kind`` which way: "connection", "timeout" or "status" (then
    ``status`` is that HTTP status)."""

    def __init__(self, attempts: int, last: str, kind: str, status: int | None = None):
        super().__init__(f"{attempts} attempts (last: {last})")
        self.attempts, self.last, self.kind, self.status = attempts, last, kind, status


def split_http_url(url: str) -> tuple[str, str, int | None, str] | None:
    """(scheme, host, port or None when not written, path without its trailing /) of an http(s)
    URL; None when it is not one (another scheme, no host, a port that is not a number, a
    query)."""
    parts = urlsplit(url or "")
    try:
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        return None
    return parts.scheme, parts.hostname, port, parts.path.rstrip("/")


def send(scheme: str, host: str, port: int, method: str, path: str, body: bytes | None,
         headers: dict[str, str], connect_timeout: float, read_timeout: float
         ) -> tuple[int, bytes]:
    """(status, body) of one request on a new connection: ``connect_timeout`` to open it,
    ``read_timeout`` for every read after (a silent server raises TimeoutError)."""
    kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = kind(host, port, timeout=connect_timeout)
    try:
        conn.connect()
        conn.sock.settimeout(read_timeout)
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def with_retries(attempt: Callable[[], tuple[int, bytes]], *, retries: int, backoff: float,
                 retry_statuses: tuple[int, ...]) -> tuple[int, bytes]:
    """The first answer of ``attempt()`` whose status is not in ``retry_statuses``; a connection
    error, a timeout or such a status is tried again up to ``retries`` times, after
    ``backoff``, 2 ``backoff``, 4 ``backoff``... seconds. Then RetriesExhausted."""
    last, kind, status = "", "connection", None
    for index in range(retries + 1):
        if index:
            time.sleep(backoff * 2 ** (index - 1))
        try:
            status, data = attempt()
        except (OSError, http.client.HTTPException) as err:
            last, status = f"{type(err).__name__}: {err}", None
            kind = "timeout" if isinstance(err, TimeoutError) else "connection"
            continue
        if status in retry_statuses:
            last, kind = f"HTTP {status}", "status"
            continue
        return status, data
    raise RetriesExhausted(retries + 1, last, kind, status)
