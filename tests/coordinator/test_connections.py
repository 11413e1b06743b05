"""coordinator/connections.py: the HTTP server's bounds per connection (a head deadline and size cap,
a body rate floor, connections per address), over real loopback sockets to a bare ASGI app under
uvicorn with each of its HTTP protocols; and BodyMeter's arithmetic. Deadlines here are short and
every assertion on time is a lower bound or a generous upper one."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import pickle
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from coordinator.connection_bounds import BodyMeter, ConnectionLimits
from coordinator.connections import ConnectionGuard, Guarded
from coordinator.settings import CoordinatorSettings


class GuardedHttptools(Guarded, HttpToolsProtocol):
    pass


class GuardedH11(Guarded, H11Protocol):
    pass


# each parser on one of the event loops uvicorn may run (uvloop when installed: what `serve` gets)
PROTOCOLS = {"httptools+uvloop": (GuardedHttptools, "uvloop"), "h11+asyncio": (GuardedH11, "asyncio")}
SHORT = ConnectionLimits(head_timeout_s=0.5, body_grace_s=0.5, min_body_bytes_per_s=1000, max_per_address=100)
LONG_S = 30.0  # the most any cut here may take on a loaded machine


class App:
    """GET: 200 "ok". POST: reads its body (after sleeping `read_after_s`), answers how many bytes,
    and notes in `bodies` what it read: the byte count, or "disconnect"."""

    def __init__(self, *, read_after_s: float = 0.0) -> None:
        self.read_after_s = read_after_s
        self.bodies: list[int | str] = []

    async def __call__(self, scope, receive, send) -> None:
        assert scope["type"] == "http"
        n = 0
        if scope["method"] == "POST":
            await asyncio.sleep(self.read_after_s)
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.bodies.append("disconnect")
                    return
                n += len(message.get("body", b""))
                if not message.get("more_body"):
                    break
            self.bodies.append(n)
        body = str(n).encode() if scope["method"] == "POST" else b"ok"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def serving(app, limits: ConnectionLimits, protocol) -> Iterator[tuple[int, ConnectionGuard]]:
    """`app` under uvicorn on a loopback port, in a thread, with the guard over `protocol` (a class and
    an event loop): (port, guard)."""
    guard = ConnectionGuard(limits, protocol=protocol[0])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=guard, loop=protocol[1], lifespan="off", log_level="warning",
                                           timeout_keep_alive=60))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield sock.getsockname()[1], guard
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.settimeout(LONG_S)
    s.connect(("127.0.0.1", port))
    return s


def read_all(s: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def answer(s: socket.socket) -> tuple[int, bytes]:
    """One response: (status, head and body so far)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed without an answer: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
    while len(rest) < length:
        rest += s.recv(65536)
    return int(head.split(b" ", 2)[1]), data


def get(s: socket.socket) -> int:
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    return answer(s)[0]


def trickle(s: socket.socket, piece: bytes, *, every_s: float, until_s: float) -> None:
    """Send `piece` every `every_s` until the server closes the connection, or `until_s` passed."""
    end = time.monotonic() + until_s
    with contextlib.suppress(OSError):
        while time.monotonic() < end:
            s.sendall(piece)
            time.sleep(every_s)


@pytest.fixture(params=sorted(PROTOCOLS))
def protocol(request):
    return PROTOCOLS[request.param]


# -- the head --------------------------------------------------------------------------------------


def test_a_connection_that_sends_nothing_is_closed_at_the_head_deadline(protocol):
    with serving(App(), SHORT, protocol) as (port, _):
        with connect(port) as s:
            t0 = time.monotonic()
            assert read_all(s) == b""  # before: open for ever (uvicorn's keep-alive starts after a first answer)
            assert time.monotonic() - t0 >= 0.4


def test_uvicorn_alone_never_closes_a_connection_that_sends_nothing():
    """The quirk the head deadline is for: keep-alive 1 s, and the silent socket still open after 3 s."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(App(), lifespan="off", log_level="warning", timeout_keep_alive=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        with connect(sock.getsockname()[1]) as s:
            s.settimeout(3)
            with pytest.raises(TimeoutError):
                s.recv(1)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_a_head_that_trickles_gets_408_and_is_closed(protocol):
    with serving(App(), SHORT, protocol) as (port, guard):
        with connect(port) as s:
            s.sendall(b"GET / HTTP/1.1\r\n")
            t0 = time.monotonic()
            sender = threading.Thread(target=trickle, args=(s, b"X-A: b\r\n"), kwargs={"every_s": 0.05,
                                                                                     "until_s": LONG_S})
            sender.start()
            data = read_all(s)
            sender.join()
        assert data.startswith(b"HTTP/1.1 408 ") and b"connection: close" in data, data
        assert b"did not arrive within 0.5 s" in data
        assert time.monotonic() - t0 >= 0.4
        assert guard.open_count("127.0.0.1") == 0


def test_a_kept_alive_connection_waits_idle_then_gets_the_deadline_from_its_next_first_byte(protocol):
    with serving(App(), SHORT, protocol) as (port, _):
        with connect(port) as s:
            assert get(s) == 200
            time.sleep(1.0)  # twice the head deadline, idle: uvicorn's keep-alive (60 s) governs it
            assert get(s) == 200
            s.sendall(b"GET / HTTP/1.1\r\n")  # then a head that stops half-way
            data = read_all(s)
        assert data.startswith(b"HTTP/1.1 408 "), data


def test_a_head_over_16_kib_is_431_and_closed(protocol):
    with serving(App(), SHORT, protocol) as (port, _):
        with connect(port) as s:
            with contextlib.suppress(OSError):  # the server may close while the rest is on its way
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 10))
            data = read_all(s)
        # before, with httptools: 20 MB of headers were taken in without an answer
        assert data.startswith(b"HTTP/1.1 431 ") or (protocol[0] is GuardedH11 and data.startswith(b"HTTP/1.1 400 ")), data


# -- the body --------------------------------------------------------------------------------------

POST = b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n"


def test_a_body_below_the_floor_after_the_grace_is_408_and_the_app_reads_a_disconnect(protocol):
    app = App()
    with serving(app, SHORT, protocol) as (port, guard):
        with connect(port) as s:
            s.sendall(POST % 100_000)
            t0 = time.monotonic()
            sender = threading.Thread(target=trickle, args=(s, b"x" * 10), kwargs={"every_s": 0.1, "until_s": LONG_S})
            sender.start()
            data = read_all(s)  # before: 10 B/s kept it open until the body ended (2.8 hours)
            sender.join()
        assert data.startswith(b"HTTP/1.1 408 ") and b"below the 1000 bytes/s" in data, data
        assert time.monotonic() - t0 >= 0.4
        deadline = time.monotonic() + LONG_S
        while not app.bodies and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.bodies == ["disconnect"]  # the app dropped what it read; its own answer was never sent
        assert guard.open_count("127.0.0.1") == 0


def test_a_body_that_keeps_the_floor_is_served(protocol):
    app = App()
    with serving(app, SHORT, protocol) as (port, _):
        with connect(port) as s:
            s.sendall(POST % 12_000)
            for _ in range(30):  # 400 bytes every 0.1 s: 4000 B/s for 3 s, four times the floor
                s.sendall(b"x" * 400)
                time.sleep(0.1)
            assert answer(s)[0] == 200
    assert app.bodies == [12_000]


def test_time_the_server_does_not_read_is_not_held_against_the_body(protocol):
    """The app reads only after 4 s. uvicorn stops reading once 64 KiB wait for it: those seconds are the
    server's, not the client's (counted, the 2 MB body sent at once would fall below 100 KB/s)."""
    app = App(read_after_s=4.0)
    limits = ConnectionLimits(head_timeout_s=5, body_grace_s=0.2, min_body_bytes_per_s=100_000, max_per_address=100)
    with serving(app, limits, protocol) as (port, _):
        with connect(port) as s:
            sender = threading.Thread(target=s.sendall, args=(POST % (2 << 20) + b"x" * (2 << 20),))
            sender.start()
            status, data = answer(s)
            sender.join()
    assert status == 200, data
    assert app.bodies == [2 << 20]


# -- connections per address -----------------------------------------------------------------------


def test_connections_past_the_per_address_cap_get_503_and_are_closed_at_once(protocol):
    limits = ConnectionLimits(head_timeout_s=30, body_grace_s=1, min_body_bytes_per_s=1000, max_per_address=3)
    with serving(App(), limits, protocol) as (port, guard):
        held = [connect(port) for _ in range(3)]
        try:
            with connect(port) as over:  # before: held open like the others
                data = read_all(over)
            assert data.startswith(b"HTTP/1.1 503 ") and b"retry-after: 5" in data, data
            assert b"3 connections open" in data
            with connect(port, source="127.0.0.2") as other:  # another address is served
                assert get(other) == 200
            assert get(held[0]) == 200  # and so are the three admitted
            held.pop().close()
            deadline = time.monotonic() + LONG_S
            while guard.open_count("127.0.0.1") > 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with connect(port) as again:  # one closed: room for one more
                assert get(again) == 200
        finally:
            for s in held:
                s.close()


def test_the_believed_proxies_connections_are_never_capped(protocol):
    limits = ConnectionLimits(head_timeout_s=30, body_grace_s=1, min_body_bytes_per_s=1000, max_per_address=2,
                              exempt=(ipaddress.ip_network("127.0.0.1/32"),))
    with serving(App(), limits, protocol) as (port, _):
        held = [connect(port) for _ in range(5)]
        try:
            assert [get(s) for s in held] == [200] * 5
        finally:
            for s in held:
                s.close()


# -- the pieces ------------------------------------------------------------------------------------


def test_body_meter_holds_the_average_after_the_grace_and_skips_the_servers_own_pauses():
    m = BodyMeter(100.0, grace_s=10, bytes_per_s=1000)
    assert not m.behind(110.0) and m.behind(110.001)  # nothing sent: behind the moment the grace ends
    assert m.due(100.0) == 110.0
    m.add(5000)
    assert m.due(104.0) == 115.0 and not m.behind(115.0) and m.behind(115.5)
    m.pause(112.0)  # the server stopped reading for 20 s
    assert m.due(120.0) is None and not m.behind(130.0)
    m.resume(132.0)
    assert m.active_s(132.0) == 12.0 and m.due(132.0) == 135.0


def test_the_limits_come_from_the_settings_and_the_guard_pickles_for_each_process():
    settings = CoordinatorSettings(forwarded_allow_ips="127.0.0.1, 10.0.0.0/8", head_timeout_s=7,
                                   max_connections_per_address=9)
    limits = ConnectionLimits.from_settings(settings)
    assert (limits.head_timeout_s, limits.body_grace_s, limits.min_body_bytes_per_s, limits.max_per_address) == (
        7, 10, 2048, 9)
    assert [limits.capped(h) for h in ("127.0.0.1", "10.1.2.3", "::ffff:10.1.2.3", "127.0.0.2", "2001:db8::1")] == [
        False, False, False, True, True]
    assert not ConnectionLimits.from_settings(CoordinatorSettings(forwarded_allow_ips="*")).capped("192.0.2.1")
    guard = ConnectionGuard(limits)
    assert guard.admit("127.0.0.2")
    copy = pickle.loads(pickle.dumps(guard))  # what uvicorn hands each of --processes N
    assert copy.limits == limits and copy.open_count("127.0.0.2") == 0
