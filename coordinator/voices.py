"""Which tokens speak as one (pure): a delta's *voice*, the key robust merging counts it under.

A worker's deltas speak in its own voice, except those of tokens that reach the coordinator from one
network address (an IPv4 address, an IPv6 /64: ratelimit.client_key), which share one: four tokens of
one attacker are then one voice in the screen's median, share one worker's merge weight, and are
judged (throttled, banned) together (coordinator/trust.py). Tokens are one voice only where nothing
vouches for them apart:

  - a verified member of a registered team (workers.team_id: the operator gave its lab a key) speaks
    in its own voice however many share its address;
  - an address among `ungrouped` (the coordinator's own machine by default, where the operator's own
    workers and the demo run) or a client that is no network address (a unix socket, a test client).

The voice is fixed when a delta is acknowledged and stored with it, so a replay decides alike. It is
a digest of the address, not the address: the checkpoint and the screen's state never hold one.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Sequence

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def networks(spec: str) -> list[Network]:
    """`spec`'s comma-separated addresses or networks (ValueError, naming the bad one, otherwise)."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if part:
            try:
                out.append(ipaddress.ip_network(part, strict=False))
            except ValueError:
                raise ValueError(f"{part!r} is not an address or network (e.g. 127.0.0.1 or 10.0.0.0/8)") from None
    return out


def voice_of(client: str | None, *, team_id: int | None, ungrouped: Sequence[Network]) -> str | None:
    """The voice a delta of a lease granted to `client` (its counted address) speaks in: None for the
    worker's own, else the address's shared one (see the module's docstring)."""
    if team_id is not None or not client:
        return None
    try:
        addr = ipaddress.ip_network(client, strict=False)
    except ValueError:
        return None  # no network address
    if any(addr.version == net.version and addr.subnet_of(net) for net in ungrouped):
        return None
    return "@" + hashlib.blake2b(str(addr).encode(), digest_size=8).hexdigest()
