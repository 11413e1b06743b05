"""Where a request's time went: named phases, sent back in a W3C `Server-Timing` header.

    Server-Timing: auth;dur=0.61, check;dur=1.02, validate;dur=0.52, lock;dur=0.40, write;dur=0.93,
                   commit;dur=1.71, total;dur=6.10

The service wraps its steps in `phase(name)`; `ServerTiming` (an ASGI middleware) collects them
for each HTTP request and adds the header to the answer, with `total`, the time from the request
reaching the app to its answer starting (what the phases leave out of it: reading the body,
waiting for a thread of the pool). A client that measures its own latency sees the rest (the
network, the server's event loop) as the difference. Browsers show the header in their developer
tools; `python -m bench load` breaks its slowest requests down with it. Outside a request,
`phase` does nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar

_spans: ContextVar[list[tuple[str, float]] | None] = ContextVar("idletrain_timing", default=None)

HEADER = "server-timing"


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as `name` in the current request's Server-Timing (nothing outside a request).
    A phase entered twice in one request is reported once, with the durations added."""
    spans = _spans.get()
    if spans is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        spans.append((name, time.perf_counter() - t0))


def header_value(spans: list[tuple[str, float]], total_s: float) -> str:
    summed: dict[str, float] = {}
    for name, seconds in spans:
        summed[name] = summed.get(name, 0.0) + seconds
    return ", ".join(f"{name};dur={1000 * s:.2f}" for name, s in [*summed.items(), ("total", total_s)])


def parse(value: str | None) -> dict[str, float]:
    """A Server-Timing header -> {name: milliseconds} (entries without a duration are left out)."""
    out: dict[str, float] = {}
    for item in (value or "").split(","):
        name, *params = [p.strip() for p in item.split(";")]
        for param in params:
            key, _, dur = param.partition("=")
            if name and key == "dur":
                try:
                    out[name] = float(dur)
                except ValueError:
                    pass
    return out


class ServerTiming:
    """ASGI middleware: a fresh phase list per HTTP request, the header on its answer."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        spans: list[tuple[str, float]] = []
        token = _spans.set(spans)
        t0 = time.perf_counter()

        async def send_timed(message) -> None:
            if message["type"] == "http.response.start":
                value = header_value(spans, time.perf_counter() - t0).encode("latin-1")
                message = {**message, "headers": [*message.get("headers", []), (HEADER.encode(), value)]}
            await send(message)

        try:
            await self.app(scope, receive, send_timed)
        finally:
            _spans.reset(token)
