"""Request bodies of the binary routes (uploads, exchanges): read under a cap and a stall timeout,
or streamed to a file as they arrive."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path

from fastapi import Request
from starlette.requests import ClientDisconnect

from coordinator.errors import PayloadTooLarge, RequestTimeout, ServiceError
from coordinator.storage import ReceivedBody
from shared import protocol

# the OpenAPI description of a binary request body
OCTET = {"requestBody": {"required": True, "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


def require_octet_stream(request: Request, what: str) -> None:
    """400 unless the body is sent as application/octet-stream."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip()
    if ctype != "application/octet-stream":
        raise ServiceError(f"send {what} as application/octet-stream, not {ctype or 'nothing'}")


def _cap_header(cap: int) -> dict[str, str]:
    """A 413 says the cap it enforced, so a worker can say by how much it is over."""
    return {protocol.H_MAX_BODY: str(cap)}


async def read_capped(request: Request, cap: int, *, stall_s: float | None = None) -> bytes:
    """The request body, refused with 413 as soon as it passes `cap` bytes (counted while streaming)
    and with 408 when no byte comes for `stall_s` seconds."""
    chunks: list[bytes] = []
    await _receive(request, chunks.append, cap=cap, stall_s=stall_s)
    return b"".join(chunks)


async def receive_to_file(request: Request, path: Path, *, cap: int, stall_s: float | None) -> ReceivedBody:
    """The request body written to `path` as it arrives (never whole in memory) and hashed on the way;
    413 past `cap` bytes, 408 after `stall_s` seconds without a byte. The file is not fsynced (that
    waits until the body passed its checks: Storage.stage_received); on a refusal it is left for the
    caller to delete."""
    digest = hashlib.sha256()
    with open(path, "xb") as f:
        def sink(chunk: bytes) -> None:
            digest.update(chunk)
            f.write(chunk)

        size = await _receive(request, sink, cap=cap, stall_s=stall_s)
    return ReceivedBody(path=path, sha256=digest.hexdigest(), size=size)


async def _receive(request: Request, sink: Callable[[bytes], object], *, cap: int, stall_s: float | None) -> int:
    """Feed the body's chunks to `sink`; returns its size. 413 before reading a byte when
    Content-Length says more than `cap`, else as soon as the count passes it; 408 when the next
    chunk takes more than `stall_s` seconds (a slow client holds a connection, a task and what it
    sent so far: 200 slow connections were never timed out)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the limit of {cap} bytes", headers=_cap_header(cap))
    size = 0
    stream = request.stream()
    try:
        while True:
            try:
                async with asyncio.timeout(stall_s):
                    chunk = await anext(stream)
            except StopAsyncIteration:
                return size
            except TimeoutError:
                raise RequestTimeout(f"the body stopped arriving: no byte for {stall_s:g} s after {size} bytes; "
                                     "send it again") from None
            size += len(chunk)
            if size > cap:
                raise PayloadTooLarge(f"body exceeds the limit of {cap} bytes", headers=_cap_header(cap))
            sink(chunk)
    except ClientDisconnect:  # the worker went away mid-upload: nothing was received, nothing changes
        raise ServiceError("the upload was cut off before its end; send it again") from None
    finally:
        await stream.aclose()
