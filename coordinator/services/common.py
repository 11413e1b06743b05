"""What the services share: the worker a request comes from, small checks."""

from __future__ import annotations

import dataclasses
import hashlib
from datetime import datetime, timezone

from coordinator.errors import Forbidden, NotFound, TooManyRequests
from coordinator.ratelimit import RateLimiter


@dataclasses.dataclass
class Caller:
    """The worker a request comes from, as authentication read it (WorkerService.authenticate)."""

    id: int
    run_id: int
    revoked: bool
    standing: str
    standing_reason: str | None
    last_seen: datetime
    last_lease_at: datetime | None
    team_id: int | None = None  # set: a verified member of that registered team


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def aware(dt: datetime) -> datetime:
    """SQLite hands datetimes back naive; they were stored as UTC."""
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def aware_or_none(dt: datetime | None) -> datetime | None:
    return None if dt is None else aware(dt)


def named_run(run, name: str):
    """`run` (a row with the run's state), if it exists and is created: else 404."""
    if run is None or run.state == "creating":
        raise NotFound(f"no run named {name!r}")
    return run


def owned(lease, lease_id: int, worker: Caller):
    """`lease` (a row with its worker_id), if it exists and is `worker`'s: else 404 / 403."""
    if lease is None:
        raise NotFound(f"no lease {lease_id}")
    if lease.worker_id != worker.id:
        raise Forbidden(f"lease {lease_id} belongs to another worker")
    return lease


def rate_limit(limiter: RateLimiter, action: str, worker: Caller) -> None:
    """429 when this worker is over its `action` budget (settings: <action>_rate, <action>_burst)."""
    wait = limiter.take(action, worker.id)
    if wait > 0:
        raise TooManyRequests(f"too many {action} requests from this worker; retry in {wait:.1f} s",
                              retry_after=wait)
