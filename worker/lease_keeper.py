"""Keep a lease alive while its round makes progress.

A volunteer's machine may be slower than the run's lease TTL assumed. While the round is
training, a background thread renews the lease once two thirds of its time have passed, so the
shard is not handed to someone else under a machine that is still working on it. It renews only
if the round moved since the last renewal, and it tells the coordinator the step it reached (the
coordinator renews only a lease whose step moved on, and only up to a lifetime of a few rounds): a
paused or stuck worker lets its lease run out, as it should (worker/governor.py already lets a long
pause give the lease up).

A refusal (the lease expired or was given up) ends the keeping; the upload will say what
happened. Network errors are retried at the next tick.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timezone

log = logging.getLogger(__name__)


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


class LeaseKeeper:
    def __init__(self, lease_id: int, deadline: datetime, *, renew: Callable[[int, int], datetime],
                 progress: Callable[[], int], clock: Callable[[], datetime] = _utcnow,
                 min_wait_s: float = 1.0) -> None:
        self.lease_id = lease_id
        self.deadline = deadline
        self.renew, self.progress, self.clock = renew, progress, clock
        now = clock()
        self.ttl_s = max(1.0, (deadline - now).total_seconds())  # what the lease gave at the start
        self.min_wait_s = min_wait_s
        self.renewals = 0
        self.stopped_because: str | None = None
        self._seen = progress()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def next_wait_s(self) -> float:
        """Seconds until two thirds of the lease's time have passed (then it renews)."""
        renew_at = (self.deadline - self.clock()).total_seconds() - self.ttl_s / 3
        return max(self.min_wait_s, renew_at)

    def tick(self) -> bool:
        """One decision: renew if due and the round moved. Returns whether to keep going."""
        if (self.deadline - self.clock()).total_seconds() > self.ttl_s / 3:
            return True  # not due yet
        step = self.progress()
        if step == self._seen:
            self.stopped_because = "no progress since the last renewal"
            log.info("lease %d: no progress, letting it run out", self.lease_id)
            return False
        try:
            self.deadline = self.renew(self.lease_id, step)
        except Exception as exc:  # refused (expired, given up) or the network: the upload will tell
            status = getattr(exc, "status", None)
            if status in (404, 409, 410, 403, 422):
                self.stopped_because = f"refused ({status})"
                log.warning("lease %d could not be renewed: %s", self.lease_id, exc)
                return False
            log.info("lease %d: renewal failed (%s); trying again soon", self.lease_id, exc)
            return True
        self._seen = step
        self.renewals += 1
        log.debug("lease %d renewed until %s", self.lease_id, self.deadline.isoformat())
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.next_wait_s()):
            if not self.tick():
                return

    def __enter__(self) -> LeaseKeeper:
        self._thread = threading.Thread(target=self._run, name=f"lease-keeper-{self.lease_id}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
