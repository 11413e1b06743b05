"""Host header validation against DNS rebinding (a pure check plus the ASGI middleware applying it).

A page on evil.example can have its name re-resolve to 127.0.0.1 and then talk to a coordinator on
the victim's loopback as if it were same-origin; what gives it away is `Host: evil.example`. The
coordinator answers only the names it is known by (CoordinatorSettings.allowed_hosts): the loopback
names and the bind host always, plus those listed. Bound to every address (0.0.0.0, ::) with none
listed it answers any name: a public server's Host is its public name, which it cannot know, and
the admin token (always required) is what guards its operator routes.
"""

from __future__ import annotations

import ipaddress

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from coordinator.settings import CoordinatorSettings

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def host_name(header: str) -> str:
    """The name in a Host header: no port, no IPv6 brackets, lower case (`[::1]:8000` -> `::1`)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    name, sep, port = header.rpartition(":")
    return name if sep and port.isdigit() and ":" not in name else header


def allowed_hosts(settings: CoordinatorSettings) -> frozenset[str] | None:
    """The names this coordinator answers to; None: any (bound to every address, none listed)."""
    bind = host_name(settings.host)
    if not settings.allowed_hosts and _unspecified(bind):
        return None
    return frozenset({*LOOPBACK_NAMES, bind, *(h.strip().lower() for h in settings.allowed_hosts)})


def is_allowed(header: str | None, allowed: frozenset[str] | None) -> bool:
    if allowed is None or "*" in allowed:
        return True
    if not header:
        return False
    name = host_name(header)
    if name in allowed or _loopback_ip(name):
        return True
    return any(p.startswith("*.") and name.endswith(p[1:]) for p in allowed)


class HostGuard:
    """ASGI middleware: 400 `{"detail": why}` for a request whose Host is not among `allowed`."""

    def __init__(self, app: ASGIApp, *, allowed: frozenset[str] | None) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.allowed is not None:
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if not is_allowed(header, self.allowed):
                detail = (f"this coordinator does not answer to Host {header!r}" if header else
                          "send a Host header") + (
                    "; the operator allows more names with IDLETRAIN_ALLOWED_HOSTS (comma-separated)")
                await JSONResponse({"detail": detail}, status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _unspecified(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_unspecified
    except ValueError:
        return False


def _loopback_ip(name: str) -> bool:
    """127.0.0.0/8 and ::1 as literals: no DNS name is involved, so nothing can rebind them."""
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
