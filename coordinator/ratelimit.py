"""Rate limits: a token bucket per (action, key) in the coordinator's memory; the key is a worker
id, or the client's address for registration (which comes before any token).

A bucket holds up to `burst` tokens and refills at `rate` per second; each request takes one.
An empty bucket answers how long until the next token, which becomes a 429's Retry-After.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable, Hashable


def client_key(host: str | None) -> str:
    """The key a client address is counted under: an IPv4 address itself, an IPv6 address by its /64
    (one home connection gets a whole /64, so its single addresses cost an attacker nothing), anything
    else (a test client's name, a unix socket) as it is; "?" when unknown."""
    if not host:
        return "?"
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host[:64]
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


class RateLimiter:
    def __init__(self, limits: dict[str, tuple[float, float]], *, clock: Callable[[], float] = time.monotonic) -> None:
        """limits: action -> (rate per second, burst); a rate of 0 means unlimited."""
        self.limits = limits
        self.clock = clock
        self._buckets: dict[tuple[str, Hashable], tuple[float, float]] = {}  # -> (tokens, last refill time)
        self._lock = threading.Lock()

    def take(self, action: str, key: Hashable) -> float:
        """Take one token; returns 0 if allowed, else the seconds to wait (nothing is taken then)."""
        rate, burst = self.limits.get(action, (0.0, 0.0))
        if rate <= 0:
            return 0.0
        now = self.clock()
        with self._lock:
            tokens, last = self._buckets.get((action, key), (burst, now))
            tokens = min(burst, tokens + (now - last) * rate)
            if tokens < 1.0:
                self._buckets[(action, key)] = (tokens, now)
                return (1.0 - tokens) / rate
            self._buckets[(action, key)] = (tokens - 1.0, now)
            return 0.0
