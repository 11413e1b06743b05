"""Local processes over loopback, for the demo, the benchmarks (bench/, in a source checkout) and the
tests: a free port to serve on, and waiting until a started coordinator answers /healthz. It imports
nothing of the CLI nor of bench, so each of them may use it."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(client: httpx.Client, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Wait until the coordinator process answers /healthz; RuntimeError if it dies or stays silent."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the coordinator exited during start-up; see its log")
        try:
            if client.get("/healthz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the coordinator did not answer /healthz within {timeout_s:g} s")
