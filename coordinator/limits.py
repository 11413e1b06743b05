"""Bounds of the HTTP layer: what one request, one worker or one process may hold at once.

    BodyCap        ASGI middleware: every request body but the uploads' capped at max_json_bytes
                   (413 before the app reads it: Content-Length, or counted as it streams)
    InFlight       uploads in flight per worker (max_concurrent_uploads): 429 past it
    Slots          a blocking semaphore with a deadline: decoding a body (max_validations), 503 past it
    undeliverable  why a run's deltas or exchanges could not fit max_upload_bytes (run create refuses it)

Before these, an unauthenticated registration could make the server parse 150 MiB of JSON, and
30 stalled uploads of one token held 1.8 GB (coordinator/api/uploads.py now streams them to disk).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Hashable, Iterator

from starlette.exceptions import HTTPException

from coordinator.errors import TooManyRequests, Unavailable
from shared.algorithms.compress import round_bound
from shared.algorithms.registry import ALGORITHMS, End
from shared.algorithms.sparta import exchange_bound
from shared.config import RunConfig
from shared.model import meta_schema


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def undeliverable(cfg: RunConfig, *, max_upload_bytes: int) -> str | None:
    """Why no worker could deliver this run's rounds, or None: the worst-case encoded delta (or sparse
    exchange) of its model and compression against the upload cap. Without this a run too large for
    the cap trains a whole round on every worker before its first upload gets 413."""
    schema = meta_schema(cfg.model)
    algorithm = ALGORITHMS[cfg.algorithm]
    sizes = []
    if algorithm.ends_with is End.PSEUDO_GRADIENT:
        sizes.append(("a round's delta", round_bound(schema, cfg.compression)))
    if algorithm.exchanges:
        sizes.append(("an exchange", exchange_bound(schema, p=cfg.sparta.p, values=cfg.sparta.values)))
    for what, size in sizes:
        if size > max_upload_bytes:
            return (f"{what} of this run can take up to {_size(size)} on the wire, above the "
                    f"coordinator's upload cap of {_size(max_upload_bytes)}: send fewer bytes "
                    "(compression values 'int4', or index 'topk'/'random' with a smaller fraction; for "
                    "sparta a smaller p), train a smaller model, or raise IDLETRAIN_MAX_UPLOAD_BYTES")
    return None


class BodyTooLarge(HTTPException):
    """Raised from the capped `receive` once a streamed body passes the cap. An HTTPException, so
    FastAPI's body parsing lets it through (it turns other errors into a 400) and its handler answers
    413 {"detail": ...}."""

    def __init__(self, cap: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {cap} bytes")


class BodyCap:
    """ASGI middleware: a request body over `cap` bytes is refused with 413, before the app reads
    it when Content-Length says so, else as soon as the count passes `cap` while it streams (so
    a chunked body is never held whole). Paths matching `exempt` (the delta and exchange
    uploads, which stream to disk under their own, larger cap) pass untouched."""

    def __init__(self, app, *, cap: int, exempt: re.Pattern[str]) -> None:
        self.app, self.cap, self.exempt = app, cap, exempt

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.exempt.match(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > self.cap):
            await _answer(send, 413, f"request body of {declared.decode('latin-1')[:20]} bytes exceeds the "
                                     f"limit of {self.cap} bytes")
            return
        received = 0
        started = False

        async def capped_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.cap:
                    raise BodyTooLarge(self.cap)
            return message

        async def send_tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, capped_receive, send_tracked)
        except BodyTooLarge as exc:  # read outside FastAPI's handlers (a middleware): answer here
            if started:
                raise
            await _answer(send, 413, exc.detail)


async def _answer(send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class InFlight:
    """How many requests each key (a worker id) has in flight; `hold` refuses one past `limit`."""

    RETRY_S = 2.0  # an upload of ours takes seconds; ask again after a couple

    def __init__(self, limit: int, *, what: str) -> None:
        self.limit, self.what = limit, what
        self._counts: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        with self._lock:
            n = self._counts.get(key, 0)
            if n >= self.limit:
                raise TooManyRequests(f"this worker has {n} {self.what} in flight, the most it may have at once; "
                                      f"retry when one has finished", retry_after=self.RETRY_S)
            self._counts[key] = n + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._counts[key] - 1
                if left:
                    self._counts[key] = left
                else:
                    del self._counts[key]

    def count(self, key: Hashable) -> int:
        with self._lock:
            return self._counts.get(key, 0)


class Slots:
    """At most `n` holders at once; a caller waits up to `wait_s`, then gets 503 + Retry-After."""

    RETRY_S = 2.0

    def __init__(self, n: int, *, wait_s: float, what: str) -> None:
        self._sem = threading.BoundedSemaphore(n)
        self.wait_s, self.what = wait_s, what

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        if not self._sem.acquire(timeout=self.wait_s):
            raise Unavailable(f"the coordinator is busy {self.what}; retry shortly", retry_after=self.RETRY_S)
        try:
            yield
        finally:
            self._sem.release()
