"""The bounds each connection of `coordinator serve` is held to (pure; coordinator/connections.py
applies them to uvicorn's protocol).

    ConnectionLimits  the bounds, from CoordinatorSettings, and whose connections count per address
    BodyMeter         whether a request body keeps to the floor rate after its grace
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

MAX_HEAD_BYTES = 16 << 10  # a request line and headers of ours are well under 1 KB; h11's default, stated


@dataclass(frozen=True)
class ConnectionLimits:
    head_timeout_s: float
    body_grace_s: float
    min_body_bytes_per_s: float  # 0: no floor
    max_per_address: int
    # whose connections are never counted per address (the believed proxies); None: anyone's
    exempt: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] | None = ()
    max_head_bytes: int = MAX_HEAD_BYTES

    @classmethod
    def from_settings(cls, settings) -> ConnectionLimits:
        return cls(head_timeout_s=settings.head_timeout_s, body_grace_s=settings.body_grace_s,
                   min_body_bytes_per_s=settings.min_body_bytes_per_s,
                   max_per_address=settings.max_connections_per_address, exempt=settings.believed_proxies)

    def capped(self, host: str | None) -> bool:
        """Whether connections from `host` count against max_per_address: all but the believed
        proxies' (behind nginx every connection is nginx's, which applies the cap itself)."""
        if self.exempt is None:
            return False
        try:
            addr = ipaddress.ip_address((host or "").strip("[]"))
        except ValueError:
            return True
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return not any(addr in net for net in self.exempt)


class BodyMeter:
    """A request body against the floor: after `grace_s`, the bytes received since it began must be at
    least `bytes_per_s` x (its seconds - grace_s). Seconds while the server itself does not read (uvicorn
    pauses reading while the app has not taken what arrived) do not count. Times are the caller's clock."""

    def __init__(self, now: float, *, grace_s: float, bytes_per_s: float) -> None:
        self.started, self.grace_s, self.bytes_per_s = now, grace_s, bytes_per_s
        self.received = 0
        self._paused_s = 0.0
        self._paused_at: float | None = None

    def add(self, n: int) -> None:
        self.received += n

    def pause(self, now: float) -> None:
        if self._paused_at is None:
            self._paused_at = now

    def resume(self, now: float) -> None:
        if self._paused_at is not None:
            self._paused_s += now - self._paused_at
            self._paused_at = None

    def active_s(self, now: float) -> float:
        """Seconds since the body began, less those the server did not read."""
        paused = self._paused_s + (now - self._paused_at if self._paused_at is not None else 0.0)
        return now - self.started - paused

    def behind(self, now: float) -> bool:
        return self.received < self.bytes_per_s * (self.active_s(now) - self.grace_s)

    def due(self, now: float) -> float | None:
        """When the body falls behind if no byte comes; None while the server does not read."""
        if self._paused_at is not None:
            return None
        return now + self.grace_s + self.received / self.bytes_per_s - self.active_s(now)
