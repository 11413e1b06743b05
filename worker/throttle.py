"""The volunteer's network budget: bandwidth limits and a daily transfer cap.

    TokenBucket    paces bytes to a rate (--max-upload-kbps, --max-download-kbps); the client asks it
                   before each chunk of a request body it sends and each chunk of an answer it reads,
                   so the limit holds on the wire (an unread socket makes TCP slow the sender down)
    DailyTransfer  bytes sent + received per UTC day, kept in state_dir/transfer.json so that a
                   restart does not reset the count; shared by the worker processes of one state dir

Rates are given in kilobits per second, as connection speeds are quoted (1000 kbps = 125 KB/s).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from worker.policy import utc_day

log = logging.getLogger(__name__)


def kbps_to_bytes_per_s(kbps: float) -> float:
    return kbps * 1000.0 / 8.0


class TokenBucket:
    """`rate` bytes per second on average, bursts up to `burst` bytes.

    take(n) lets n bytes pass now and, if that overdraws the bucket, sleeps until the debt is paid:
    a chunk larger than the burst still passes, at the rate. Thread-safe (the sparta exchange
    thread and the main loop share one client); the sleep happens outside the lock, so callers
    queue by the debt they found."""

    def __init__(self, rate_bytes_per_s: float, *, burst_bytes: float | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError(f"a rate must be positive, got {rate_bytes_per_s}")
        self.rate = float(rate_bytes_per_s)
        # A quarter second of traffic, at least 4 KiB: small enough to keep the rate smooth.
        self.burst = float(burst_bytes if burst_bytes is not None else max(4096.0, self.rate / 4))
        self.clock, self.sleep = clock, sleep
        self._tokens = self.burst
        self._at = clock()
        self._lock = threading.Lock()

    @property
    def chunk_bytes(self) -> int:
        """A good size for the pieces a body is sent or read in."""
        return int(min(64 * 1024, max(1024.0, self.burst)))

    def take(self, n: int) -> float:
        """Let n bytes pass; returns the seconds slept for them."""
        with self._lock:
            now = self.clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self.sleep(wait)
        return wait


def paced(body: bytes, bucket: TokenBucket, *, count: Callable[[int], None] | None = None) -> Iterator[bytes]:
    """A request body in chunks, each let through by the bucket (and counted) before it is sent."""
    step = bucket.chunk_bytes
    view = memoryview(body)
    for at in range(0, len(body), step):
        chunk = bytes(view[at:at + step])
        bucket.take(len(chunk))
        if count is not None:
            count(len(chunk))
        yield chunk


class DailyTransfer:
    """Bytes moved since 00:00 UTC, persisted in `path` ({"format": 1, "day": "YYYY-MM-DD", "bytes": N}).

    add() is called from the client for every chunk; the count reaches the file every
    `flush_bytes` or `flush_s`, and at close(), under an advisory lock, adding to what the file
    holds: workers of several runs sharing a state dir share one budget. A crash loses at most the
    last unflushed megabyte of accounting (the file is replaced atomically, not fsynced: it is
    written often and is worth less than the wear)."""

    FORMAT = 1

    def __init__(self, path: Path, *, cap_bytes: int | None = None,
                 now: Callable[[], datetime] = lambda: datetime.now(UTC),
                 clock: Callable[[], float] = time.monotonic, flush_bytes: int = 1 << 20, flush_s: float = 5.0) -> None:
        self.path = Path(path)
        self.cap_bytes = cap_bytes
        self.now, self.clock = now, clock
        self.flush_bytes, self.flush_s = flush_bytes, flush_s
        self._lock = threading.Lock()
        self._day = utc_day(now())
        self._stored = self._read(self._day)  # the file's count for the day, as last read
        self._pending = 0  # added here since
        self._flushed_at = clock()

    def _read(self, day: str) -> int:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            log.warning("transfer count %s is unreadable (%s); counting today from 0", self.path, exc)
            return 0
        if not isinstance(data, dict) or data.get("day") != day:
            return 0
        n = data.get("bytes")
        return int(n) if isinstance(n, int) and n >= 0 else 0

    def _roll(self) -> None:
        """A new UTC day: the count starts at 0 (what was pending belonged to yesterday)."""
        day = utc_day(self.now())
        if day != self._day:
            self._day, self._stored, self._pending = day, 0, 0

    def add(self, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            self._roll()
            self._pending += n
            due = self._pending >= self.flush_bytes or self.clock() - self._flushed_at >= self.flush_s
        if due:
            self.flush()

    def used_today(self) -> int:
        with self._lock:
            self._roll()
            return self._stored + self._pending

    def reached(self, extra_bytes: int = 0) -> bool:
        return self.cap_bytes is not None and self.used_today() + extra_bytes >= self.cap_bytes

    def flush(self) -> None:
        with self._lock:
            self._roll()
            pending, day = self._pending, self._day
            self._pending = 0
            self._flushed_at = self.clock()
            try:
                total = self._locked_add(day, pending)
            except OSError as exc:
                self._pending += pending  # try again at the next flush
                log.warning("cannot record today's transfer in %s (%s)", self.path, exc)
                return
            self._stored = total

    def _locked_add(self, day: str, n: int) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                import fcntl
                fcntl.flock(fd, fcntl.LOCK_EX)
            except ImportError:  # Windows: one process per state dir then
                pass
            total = self._read(day) + n
            if n:
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"format": self.FORMAT, "day": day, "bytes": total}))
                os.replace(tmp, self.path)
            return total
        finally:
            os.close(fd)  # releases the lock

    close = flush
