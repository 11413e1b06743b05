"""Between coordinator processes: the leader's loopback listener, and the relay of requests to it.

Only the leading process (coordinator/leader.py) holds the live models. The few requests that need
them (sparse exchanges, evaluations) may land on any process; the others relay them, byte for
byte with the worker's own credentials, to the leader's loopback listener and hand its answer back.
A relayed request that reaches a process which no longer leads is answered 503, never relayed again.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response

from coordinator import leader
from coordinator.errors import Unavailable
from coordinator.services.coordinator import Coordinator
from shared import protocol

log = logging.getLogger(__name__)

RELAYED = "X-Idletrain-Relayed"
_PASSED_IN = ("authorization", "content-type")
_PASSED_BACK = ("content-type", "retry-after", protocol.H_SHA256.lower())


class LeaderListener:
    """The same app on 127.0.0.1 at a free port, in a thread of the leading process."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="idletrain-leader-listener", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self.sock.close()


async def forward(request: Request, body: bytes, coord: Coordinator) -> Response:
    """Relay this request to the leading process and return its answer (503 when none answers)."""
    if request.headers.get(RELAYED):
        raise Unavailable("this coordinator process no longer holds the live model; retry")
    found = await asyncio.to_thread(leader.read, coord.settings.data_dir)
    if found is None:
        raise Unavailable("no coordinator process holds the live model right now (the merger is changing "
                          "hands); retry")
    client: httpx.AsyncClient | None = getattr(request.app.state, "relay_client", None)
    if client is None:
        client = request.app.state.relay_client = httpx.AsyncClient(timeout=60.0)
    headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED_IN}
    headers[RELAYED] = "1"
    try:
        answer = await client.request(request.method, found["url"] + request.url.path,
                                      params=request.query_params, headers=headers, content=body)
    except httpx.HTTPError as exc:
        raise Unavailable(f"the leading coordinator process did not answer ({type(exc).__name__}); retry") from None
    return Response(answer.content, status_code=answer.status_code,
                    headers={k: v for k, v in answer.headers.items() if k.lower() in _PASSED_BACK})
