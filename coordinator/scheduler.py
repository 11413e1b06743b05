"""Lease policy, pure: deadlines, a lease's lifetime, seeds, what a round costs.

No database or clock access here; the services pass in plain values and apply the answer. Which
shard goes out next is SQL (queries/leases.py claim_statement; services/leases.py pick_shard).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import datetime, timedelta


def lease_deadline(now: datetime, ttl_s: float) -> datetime:
    return now + timedelta(seconds=ttl_s)


def is_expired(deadline: datetime, now: datetime) -> bool:
    return now >= deadline


def lease_lifetime_s(round_times_s: Sequence[float], *, lease_ttl_s: float, rounds: float, cap_s: float) -> float:
    """How long a lease may live in all, renewals included, in seconds: `rounds` times the run's
    expected round (the 90th percentile of recent lease-to-delivery times, so a machine slower than
    most still finishes; lease_ttl_s before any delivery), at most `cap_s`, and never less than
    lease_ttl_s (what the lease gave at its grant). Without a cap a worker could hold a shard for
    ever by renewing it: 58 tokens once held every shard of a run that way."""
    times = sorted(t for t in round_times_s if t > 0)
    expected = times[min(len(times) - 1, int(0.9 * len(times)))] if times else lease_ttl_s
    return max(lease_ttl_s, min(cap_s, rounds * expected))


def renewed_deadline(now: datetime, *, created_at: datetime, ttl_s: float, lifetime_s: float) -> datetime:
    """A renewal's new deadline: ttl_s from now, but never past the lease's lifetime."""
    return min(now + timedelta(seconds=ttl_s), created_at + timedelta(seconds=lifetime_s))


def lease_seed(run_seed: int, lease_id: int) -> int:
    """A 63-bit seed per lease: the worker's sampling and random index selection derive from it."""
    digest = hashlib.blake2b(f"{run_seed}/{lease_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def round_tokens(*, steps: int, batch_size: int, context: int) -> int:
    return steps * batch_size * context


def dense_equivalent_bytes(*, worker_steps: int, n_params: int) -> int:
    """What data-parallel training would move for the same local steps: one dense fp32 gradient up
    and one down per step."""
    return worker_steps * 2 * 4 * n_params
