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
    # Every this many seconds a take() first drops the buckets that have refilled to their burst: such a
    # bucket answers exactly as a missing one does (a missing bucket starts full), so answers never
    # change, and the buckets kept are only those of keys seen within a refill time (burst / rate
    # seconds) plus this: memory bounded by the request rate, however many addresses (each IPv6 /64
    # is one key) an attacker cycles through.
    SWEEP_S = 10.0

    def __init__(self, limits: dict[str, tuple[float, float]], *, clock: Callable[[], float] = time.monotonic,
                 sweep_s: float | None = None) -> None:
        """limits: action -> (rate per second, burst); a rate of 0 means unlimited. sweep_s: seconds
        between sweeps of full buckets (default SWEEP_S; math.inf: never, as tests compare)."""
        self.limits = limits
        self.clock = clock
        self.sweep_s = self.SWEEP_S if sweep_s is None else sweep_s
        self._buckets: dict[tuple[str, Hashable], tuple[float, float]] = {}  # -> (tokens, last refill time)
        self._swept_at = clock()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """The buckets held now (the memory the limiter takes)."""
        return len(self._buckets)

    def _sweep(self, now: float) -> None:
        """Drop every bucket that has refilled to its burst by `now` (caller holds the lock). take()
        computes min(burst, tokens + (now - last) * rate) with a `now` no earlier than this one, so such
        a bucket would come back full: what a missing one gives."""
        limits = {action: self.limits.get(action, (0.0, 0.0)) for action in {k[0] for k in self._buckets}}
        full = [k for k, (tokens, last) in self._buckets.items()
                if tokens + (now - last) * limits[k[0]][0] >= limits[k[0]][1]]
        for k in full:
            del self._buckets[k]
        self._swept_at = now

    def take(self, action: str, key: Hashable) -> float:
        """Take one token; returns 0 if allowed, else the seconds to wait (nothing is taken then)."""
        rate, burst = self.limits.get(action, (0.0, 0.0))
        if rate <= 0:
            return 0.0
        now = self.clock()
        with self._lock:
            if now - self._swept_at >= self.sweep_s:
                self._sweep(now)
            tokens, last = self._buckets.get((action, key), (burst, now))
            tokens = min(burst, tokens + (now - last) * rate)
            if tokens < 1.0:
                self._buckets[(action, key)] = (tokens, now)
                return (1.0 - tokens) / rate
            self._buckets[(action, key)] = (tokens - 1.0, now)
            return 0.0
