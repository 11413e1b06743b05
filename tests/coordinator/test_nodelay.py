"""coordinator.connections.NoDelayHTTP: uvicorn's HTTP protocol with Nagle's algorithm off on every
connection, also on a listening socket bound the way uvicorn binds it for several processes
(socket.socket(family): proto 0, where asyncio itself leaves Nagle on)."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.server import ServerState

from coordinator.connections import NoDelayHTTP


async def _app(scope, receive, send):  # never called: only connections are made
    raise AssertionError("no request is sent")


async def _nodelay_of(protocol_class) -> int:
    """TCP_NODELAY of the server side of one loopback connection served by protocol_class."""
    config = uvicorn.Config(_app, log_level="warning")
    config.load()
    made: list[asyncio.Protocol] = []

    def factory():
        made.append(protocol_class(config=config, server_state=ServerState(), app_state={}))
        return made[-1]

    listener = socket.socket(socket.AF_INET)  # as uvicorn's Config.bind_socket does: proto 0
    listener.bind(("127.0.0.1", 0))
    server = await asyncio.get_running_loop().create_server(factory, sock=listener)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
        for _ in range(200):
            if made and made[0].transport is not None:
                break
            await asyncio.sleep(0.01)
        sock = made[0].transport.get_extra_info("socket")
        value = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
        return value
    finally:
        server.close()
        await server.wait_closed()


def test_connections_have_nagle_off_where_uvicorn_alone_leaves_it_on():
    assert listener_proto_is_zero()
    assert asyncio.run(_nodelay_of(AutoHTTPProtocol)) == 0  # the quirk this class is for
    assert asyncio.run(_nodelay_of(NoDelayHTTP)) != 0


def listener_proto_is_zero() -> bool:
    with socket.socket(socket.AF_INET) as s:
        return s.proto == 0
