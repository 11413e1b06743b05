"""deploy/nginx/idletrain.conf bounds what one address's connections may hold, as the coordinator does
on its own port (tests/e2e/test_connection_flood.py): a real nginx running the shipped site caps the
requests one address has open (limit_conn: 503 past 128) and closes a socket that sends no request
head, or sends it byte by byte, at client_header_timeout (20 s). None of it reaches the coordinator,
so none runs here: nginx refuses before it proxies anything."""

from __future__ import annotations

import contextlib
import select
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from idletrain.harness import free_port
from tests import procs
from tests.e2e.test_nginx_cache import NGINX, main_conf, render_site

PER_ADDRESS, HEAD_S = 128, 20.0  # the site's limit_conn and client_header_timeout
LATE_S = 10.0


def connect(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.9", 0))
    s.settimeout(HEAD_S + 30)
    s.connect(("127.0.0.1", port))
    return s


def closed_after(s: socket.socket, t0: float) -> tuple[bytes, float]:
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(4096):
            data += chunk
    return data, time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.skipif(NGINX is None, reason="!!! NGINX IS NOT INSTALLED: the nginx connection-limit test DID NOT RUN; "
                                          "apt-get install nginx !!!")
def test_nginx_caps_one_addresss_requests_and_times_out_request_heads(tmp_path: Path):
    port, root = free_port(), tmp_path / "nginx"
    for sub in ("cache", "tmp"):
        (root / sub).mkdir(parents=True)
    site, conf = root / "idletrain.conf", root / "nginx.conf"
    site.write_text(render_site(free_port(), port, root))  # an upstream nobody listens on: nothing gets there
    conf.write_text(main_conf(root, site))
    out = (tmp_path / "nginx.out").open("wb")
    nginx = procs.popen([NGINX, "-c", str(conf), "-p", str(root), "-g", "daemon off;"], stdout=out,
                        stderr=subprocess.STDOUT)
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() < deadline and nginx.poll() is None, procs.tail(root / "error.log")
            time.sleep(0.1)
        idle, trickling = connect(port), connect(port)
        t0 = time.monotonic()
        sender = threading.Thread(target=trickle_head, args=(trickling,), daemon=True)
        sender.start()
        # uploads whose heads are in and whose bodies never come: requests in progress for limit_conn
        for _ in range(PER_ADDRESS + 4):
            s = connect(port)
            s.sendall(b"POST /api/v1/leases/1/delta HTTP/1.1\r\nHost: train.example.org\r\n"
                      b"Content-Type: application/octet-stream\r\nContent-Length: 100000\r\n\r\n")
            held.append(s)
        time.sleep(2.0)  # the answers nginx gives at once (the rest wait for their bodies, 30 s)
        readable, _, _ = select.select(held, [], [], 0)
        answers = []
        for s in readable:
            try:
                answers.append(s.recv(64) or b"closed")
            except ConnectionResetError:  # nginx's 503 can be lost to the reset of its close
                answers.append(b"reset")
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503 ") or a == b"reset"]
        assert len(refused) == len(answers) == 4, answers  # the 128 others are held
        got_idle, idle_s = closed_after(idle, t0)
        got_trickle, trickle_s = closed_after(trickling, t0)
        assert got_idle == b"" and HEAD_S - 0.5 <= idle_s <= HEAD_S + LATE_S, (got_idle, idle_s)
        assert HEAD_S - 0.5 <= trickle_s <= HEAD_S + LATE_S, (got_trickle, trickle_s)  # not reset by each byte
    finally:
        for s in held:
            s.close()
        procs.stop(nginx, signal.SIGTERM)
        out.close()


def trickle_head(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        for byte in b"GET /healthz HTTP/1.1\r\nHost: train.example.org\r\nX-Pad: " + b"a" * 100:
            s.sendall(bytes([byte]))
            time.sleep(0.5)
