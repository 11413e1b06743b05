"""An answer's body read under a cap while it streams: never held past the cap, whatever it claims.

The body comes in raw chunks, paced by the download bucket and counted as they cross the wire, and
is decoded here rather than by httpx: identity, gzip or deflate (what the worker asks for, in
ACCEPT_ENCODING), in steps that never produce more than the cap has room for. httpx would decode a
whole chunk at once, so a 16 KB answer saying Content-Encoding: zstd became 512 MB in memory before
any cap was checked; an encoding the worker did not ask for is refused. An answer whose
Content-Length is over the cap is refused before a byte of its body is read.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable, Iterator

import httpx

from worker.throttle import TokenBucket

ACCEPT_ENCODING = "gzip, deflate"
CHUNK_BYTES = 64 << 10  # raw bytes read at a time without a download bucket
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class IntegrityError(Exception):
    """A download does not match its announced hash or size, or is over what it can weigh."""


class _Inflate:
    """gzip or deflate (zlib-wrapped, or raw as some servers send it), decoded within a budget."""

    def __init__(self, encoding: str) -> None:
        self.wbits = _WBITS[encoding]
        self.z = zlib.decompressobj(self.wbits)
        self.started = False

    def decode(self, data: bytes, room: int) -> bytes:
        """At most `room` bytes of what `data` decodes to (room bytes exactly: there may be more)."""
        try:
            out = self.z.decompress(data, room)
        except zlib.error:
            if self.started or self.wbits != zlib.MAX_WBITS:
                raise
            self.z, self.wbits = zlib.decompressobj(-zlib.MAX_WBITS), -zlib.MAX_WBITS  # raw deflate
            out = self.z.decompress(data, room)
        self.started = True
        return out


def read_body(resp: httpx.Response, *, cap: int, what: str, expected: str, bucket: TokenBucket | None,
              count: Callable[[int], None]) -> bytes:
    """The decoded body of a streamed answer, at most `cap` bytes; IntegrityError naming `what` and
    the most it can weigh (`expected`: why) once it passes the cap, the moment it does."""
    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "", *_WBITS):
        raise IntegrityError(f"{what}: the answer is encoded as {encoding[:40]!r}, which this worker does not "
                             f"ask for ({ACCEPT_ENCODING})")
    inflate = _Inflate(encoding) if encoding in _WBITS else None
    declared = resp.headers.get("content-length", "")
    if inflate is None and declared.isascii() and declared.isdecimal() and len(declared) <= 19 and int(declared) > cap:
        raise IntegrityError(f"{what}: the answer says it is {int(declared):,} bytes, over the {cap:,} {expected}; "
                             "none of it read")
    out, size = io.BytesIO(), 0
    try:
        for raw in _chunks(resp, bucket.chunk_bytes if bucket is not None else CHUNK_BYTES):
            if bucket is not None:
                bucket.take(len(raw))
            count(len(raw))
            data = raw if inflate is None else inflate.decode(raw, cap - size + 1)
            size += len(data)
            if size > cap:
                raise IntegrityError(f"{what}: the answer is over the {cap:,} bytes {expected}; refused there")
            out.write(data)
    except zlib.error as exc:
        raise IntegrityError(f"{what}: the answer's {encoding} encoding is corrupt ({exc})") from None
    if inflate is not None and inflate.started and not inflate.z.eof:
        raise IntegrityError(f"{what}: the answer's {encoding} stream is cut short")
    return out.getvalue()


def _chunks(resp: httpx.Response, size: int) -> Iterator[bytes]:
    """The answer's bytes as they came (before any decoding), in pieces of at most `size`. From the
    stream itself: iter_raw refuses an answer a transport built in memory (httpx.MockTransport's)."""
    for raw in resp.stream:
        for i in range(0, len(raw), size):
            yield raw[i:i + size]
