"""The HTTP server's own bounds on each connection, below the app (`coordinator serve`, one process
or each of --processes N): what a socket may hold without sending a request. The bounds and the
body's arithmetic are coordinator/connection_bounds.py.

    ConnectionGuard   the protocol factory `serve` hands uvicorn as `http=`: the connections each
                      address holds open in this process, one log line a minute of what was cut
    Guarded           the three bounds over a uvicorn HTTP protocol: a deadline for each request's
                      head (and a cap on its size), a rate floor for its body, connections per address
    GuardedHTTP       Guarded over NoDelayHTTP: what `serve` runs
    NoDelayHTTP       uvicorn's HTTP protocol with TCP_NODELAY on every connection

uvicorn bounds none of the three: its keep-alive timer starts after a first response, so a socket
that never sends a byte stays open for ever (1,100 of them filled limit_concurrency: every other
request got 503); its httptools parser takes headers of any size; a body that sends a byte now and
then is never cut (the app's body_timeout_s cuts only one that stops).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections import Counter
from http import HTTPStatus

from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.utils import get_remote_addr

from coordinator.connection_bounds import MAX_HEAD_BYTES, BodyMeter, ConnectionLimits
from coordinator.ratelimit import client_key

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5  # a worker refused a connection asks again after this


class NoDelayHTTP(AutoHTTPProtocol):
    """uvicorn's HTTP protocol, with TCP_NODELAY on every connection.

    asyncio turns Nagle's algorithm off only on sockets whose `proto` is IPPROTO_TCP. With several
    processes uvicorn binds the listening socket itself as socket.socket(family) (proto 0), so the
    connections it accepts keep Nagle on: a response written as headers then body waits for the
    client's delayed ACK on every request. GuardedHTTP, what `serve` runs, is one."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)


class ConnectionGuard:
    """What `serve` passes uvicorn as its HTTP protocol: called once per accepted connection, it returns
    a _Gate, which refuses the connection past its address's cap or hands it to a `protocol`
    (GuardedHTTP). Pickled to each of --processes N (uvicorn spawns them), where it starts empty:
    the counts are per process."""

    LOG_EVERY_S = 60.0
    REASONS = {"address": "over the per-address connection cap", "head": "no request head in time",
               "head_size": f"a request head over {MAX_HEAD_BYTES >> 10} KiB",
               "body": "a request body below the rate floor"}

    def __init__(self, limits: ConnectionLimits, *, protocol: type | None = None) -> None:
        self.limits, self.protocol = limits, protocol or GuardedHTTP
        self._open: dict[str, int] = {}
        self._cut: Counter[str] = Counter()
        self._last_peer: dict[str, str] = {}
        self._window = None  # the timer that writes the next summary line; None: the next cut is logged at once

    def __getstate__(self) -> dict:
        return {"limits": self.limits, "protocol": self.protocol}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["limits"], protocol=state["protocol"])

    def __call__(self, config, server_state, app_state, _loop=None) -> _Gate:
        def protocol(peer: str, counted: str | None) -> Guarded:
            return self.protocol(config=config, server_state=server_state, app_state=app_state, _loop=_loop,
                                 guard=self, peer=peer, counted=counted)

        return _Gate(self, protocol, server_state.default_headers)

    def admit(self, key: str) -> bool:
        """Count one more connection of `key`, unless it holds max_per_address already."""
        n = self._open.get(key, 0)
        if n >= self.limits.max_per_address:
            return False
        self._open[key] = n + 1
        return True

    def release(self, key: str) -> None:
        left = self._open.get(key, 1) - 1
        if left > 0:
            self._open[key] = left
        else:
            self._open.pop(key, None)

    def open_count(self, key: str) -> int:
        return self._open.get(key, 0)

    def note(self, reason: str, peer: str, loop) -> None:
        """A connection cut for `reason`: logged at once when nothing was cut in the last minute,
        else counted into the minute's one summary line (a flood would otherwise be a line per socket)."""
        if self._window is None:
            log.warning("closed a connection from %s: %s", peer, self.REASONS[reason])
            self._window = loop.call_later(self.LOG_EVERY_S, self._summary, loop)
            return
        self._cut[reason] += 1
        self._last_peer[reason] = peer

    def _summary(self, loop) -> None:
        if not self._cut:
            self._window = None
            return
        log.warning("closed connections in the last %g s: %s", self.LOG_EVERY_S, "; ".join(
            f"{n} {self.REASONS[r]} (the last from {self._last_peer[r]})" for r, n in self._cut.most_common()))
        self._cut.clear()
        self._last_peer.clear()
        self._window = loop.call_later(self.LOG_EVERY_S, self._summary, loop)


class _Gate(asyncio.Protocol):
    """Every connection's first protocol: it counts the connection against its address and refuses it
    past the cap (503, closed) before any of uvicorn's machinery is built for it, else hands the
    transport to the guarded protocol. A flood of refused connections costs little each."""

    def __init__(self, guard: ConnectionGuard, protocol, default_headers) -> None:
        self.guard, self.protocol, self.default_headers = guard, protocol, default_headers

    def connection_made(self, transport) -> None:  # type: ignore[override]
        host = (get_remote_addr(transport) or ("", 0))[0]
        peer = client_key(host)
        counted = peer if self.guard.limits.capped(host) else None
        if counted is not None and not self.guard.admit(counted):
            n = self.guard.open_count(counted)
            write_answer(transport, 503, f"this address has {n} connections open, the most this coordinator "
                         "serves one address; retry shortly with fewer at once",
                         default_headers=self.default_headers, retry_after_s=RETRY_AFTER_S)
            self.guard.note("address", peer, asyncio.get_running_loop())
            return
        protocol = self.protocol(peer, counted)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)


def write_answer(transport, status: int, detail: str, *, default_headers, retry_after_s: int | None = None) -> None:
    """A JSON {"detail": ...} answer with Connection: close, straight to the transport, which is closed."""
    body = json.dumps({"detail": detail}).encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    if retry_after_s is not None:
        head.append(f"retry-after: {retry_after_s}\r\n".encode())
    head.append(f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n".encode())
    transport.write(b"".join(head) + body)
    transport.close()


class _MeteredFlow(FlowControl):
    """uvicorn's flow control, telling the protocol when it stops and starts reading."""

    def __init__(self, transport, on_reading) -> None:
        super().__init__(transport)
        self._on_reading = on_reading

    def pause_reading(self) -> None:
        was = self.read_paused
        super().pause_reading()
        if not was:
            self._on_reading(False)

    def resume_reading(self) -> None:
        was = self.read_paused
        super().resume_reading()
        if was:
            self._on_reading(True)


class Guarded:
    """The bounds, over either of uvicorn's HTTP protocols (httptools, h11): GuardedHTTP is this over
    NoDelayHTTP, whichever of the two uvicorn picked.

    - a connection past max_per_address of its address never gets here (_Gate: 503, closed; it
      never counts toward limit_concurrency);
    - a request head must arrive within head_timeout_s of the connection's start, or of the first
      byte after the previous answer on a kept-alive connection (before that byte, uvicorn's
      keep-alive timeout); then 408, or a plain close if nothing came; past max_head_bytes, 431;
    - a body must keep min_body_bytes_per_s after body_grace_s (BodyMeter), else 408 and close: the
      app's receive() then reads a disconnect, so it drops what it streamed, and its own answer is
      not sent."""

    def __init__(self, *args, guard: ConnectionGuard, peer: str = "?", counted: str | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.guard, self.limits = guard, guard.limits
        self._peer = peer
        self._counted = counted  # the key this connection counts under (the guard admitted it), None if exempt
        self._timer = None
        self._seen = None  # the request cycle whose head was last seen complete
        self._waiting_head = False
        self._head_bytes = 0
        self._meter: BodyMeter | None = None

    # -- connection ------------------------------------------------------------------------------

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _MeteredFlow(transport, self._reading)
        self._expect_head()
        self._arm(self.loop.time() + self.limits.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._counted is not None:
            self.guard.release(self._counted)
            self._counted = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._waiting_head:
            if self._timer is None:  # the first byte after an answer: the next head's clock starts
                self._arm(self.loop.time() + self.limits.head_timeout_s)
            self._head_bytes += len(data)
        elif self._meter is not None:
            self._meter.add(len(data))
        super().data_received(data)
        self._after_parse()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not self._seen:  # h11 parses a pipelined request only now
            self._after_parse()
        elif not cycle.response_complete:  # httptools started a pipelined request it had parsed
            return
        elif cycle.more_body:  # answered before its body ended: the rest is no head, and the meter runs on
            return
        else:
            self._cancel()
            self._meter = None
            self._expect_head()  # uvicorn's keep-alive timer runs until the next byte

    # -- the bounds ------------------------------------------------------------------------------

    def _expect_head(self) -> None:
        self._waiting_head, self._head_bytes = True, 0

    def _after_parse(self) -> None:
        """After the parser took bytes: a head that arrived in full starts its body's meter; one that
        is still arriving past max_head_bytes is refused."""
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and cycle is not self._seen:
            self._seen, self._waiting_head = cycle, False
            self._cancel()
            self._meter = None
            if cycle.more_body and self.limits.min_body_bytes_per_s > 0:
                now = self.loop.time()
                self._meter = BodyMeter(now, grace_s=self.limits.body_grace_s,
                                        bytes_per_s=self.limits.min_body_bytes_per_s)
                if self.flow.read_paused:  # a pipelined request waits its turn
                    self._meter.pause(now)
                self._arm_meter()
        elif self._waiting_head and self._head_bytes > self.limits.max_head_bytes:
            self._cut("head_size", 431, f"the request head exceeds {self.limits.max_head_bytes} bytes")

    def _reading(self, reading: bool) -> None:
        if self._meter is None:
            return
        now = self.loop.time()
        if reading:
            self._meter.resume(now)
            self._arm_meter()
        else:
            self._meter.pause(now)

    def _arm_meter(self) -> None:
        now = self.loop.time()
        due = self._meter.due(now)
        if due is None:
            self._cancel()  # the server does not read: nothing to hold against the client until it does
        else:
            self._arm(max(due, now + 0.01))

    def _on_deadline(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._waiting_head:
            if self._head_bytes:
                self._cut("head", 408, f"the request head did not arrive within {self.limits.head_timeout_s:g} s")
            else:
                self.guard.note("head", self._peer, self.loop)
                self.transport.close()
            return
        meter, cycle = self._meter, self.cycle
        if meter is None or cycle is None or not cycle.more_body:
            self._meter = None  # the body is complete
            return
        now = self.loop.time()
        if not meter.behind(now):
            self._arm_meter()
            return
        rate = meter.received / max(meter.active_s(now), 1e-9)
        self._cut("body", 408, f"the request body arrived at {rate:.0f} bytes/s, below the "
                               f"{self.limits.min_body_bytes_per_s:g} bytes/s this coordinator requires after its "
                               f"first {self.limits.body_grace_s:g} s; send it again")

    def _cut(self, reason: str, status: int, detail: str) -> None:
        """Answer `status` and close, unless an answer to this request has begun (then only close).
        The app, if it holds the request, reads a disconnect next and its answer is dropped."""
        self.guard.note(reason, self._peer, self.loop)
        cycle = self.cycle if not self._waiting_head else None
        if cycle is not None:
            if cycle.response_started:
                self.transport.close()
                return
            cycle.disconnected = True
            cycle.message_event.set()
        write_answer(self.transport, status, detail, default_headers=self.server_state.default_headers)

    def _arm(self, when: float) -> None:
        self._cancel()
        self._timer = self.loop.call_at(when, self._on_deadline)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class GuardedHTTP(Guarded, NoDelayHTTP):
    """What `serve` runs: NoDelayHTTP (httptools when installed, else h11) under the guard's limits."""
