"""The next lease, its base model and its shard, fetched on a background thread near the end of a
round, so the next round starts at once while the last delta uploads.

Asking for a lease gives up the worker's earlier leases except the one the request names
(`?keep=`): only with a coordinator that says so in /healthz (`keeps_delivering_lease`, the
worker's lease_ahead) is the next lease fetched ahead (diloco), keeping the lease still training.
Without it, the next lease is asked for once the upload was answered. Either way a round's base
version cannot include the worker's own delta still uploading: leasing ahead, every delta is one
version staler than in sequence (worker/ledger.py makes up for it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import httpx
import torch

from shared import protocol
from worker.client import CoordinatorClient, CoordinatorError, why
from worker.downloads import Inputs

log = logging.getLogger(__name__)

PrepareFn = Callable[[protocol.Lease], Inputs]  # (lease) -> its base model (None: not needed), its shard


@dataclasses.dataclass
class Prefetched:
    """The next lease, its base model and its shard, fetched on a background thread near the end of
    the round before (lease_ahead): `lease` is None when there was no work or the fetch failed."""

    done: threading.Event
    lease: protocol.Lease | None = None
    base: dict[str, torch.Tensor] | None = None
    tokens: torch.Tensor | None = None
    seconds: float = 0.0


class Prefetcher:
    """`prepare(lease)` checks a lease and fetches what its round starts from; it runs on the
    prefetch thread, which touches the client, the shard cache and the held base model (which only
    it changes while the round trains). The training thread takes the result between rounds."""

    def __init__(self, client: CoordinatorClient, run: str, prepare: PrepareFn) -> None:
        self.client, self.run, self.prepare = client, run, prepare
        self.pending: Prefetched | None = None  # the next lease, fetched during the end of a round
        self.seconds = 1.0  # how long the last prefetch took: when to start the next one

    def due(self, lease: protocol.Lease, step: int, steps_per_s: float | None) -> bool:
        """Whether to start now: the round is about as many steps from its end as the last
        prefetch took, plus one."""
        left = lease.inner.steps - step
        return steps_per_s is not None and left >= 1 and left <= self.seconds * steps_per_s + 1

    def start(self, current: protocol.Lease) -> None:
        """Lease (keeping `current`, still training), base model and shard on a background thread."""
        pre = Prefetched(done=threading.Event())

        def fetch() -> None:
            t0 = time.perf_counter()
            try:
                lease, _ = self.client.lease(self.run, keep=current.lease_id)
                if lease is not None:
                    pre.base, pre.tokens = self.prepare(lease)
                    pre.lease = lease
            except Exception as exc:  # noqa: BLE001 -- the round end asks again, the usual way
                log.info("fetching the next lease ahead failed (%s); asking after the round", why(exc))
                pre.lease = None
            finally:
                pre.seconds = time.perf_counter() - t0
                pre.done.set()

        self.pending = pre
        threading.Thread(target=fetch, name="idletrain-prefetch", daemon=True).start()

    def take(self) -> Prefetched | None:
        """The prefetched lease, once fetched (waiting for it is not compute); None if there is none."""
        pre, self.pending = self.pending, None
        if pre is None:
            return None
        pre.done.wait()
        self.seconds = pre.seconds
        return pre if pre.lease is not None else None

    def release(self, timeout_s: float) -> None:
        """Stopping with a lease fetched ahead and never trained: give it back, so its shard goes back
        to the queue now rather than at the lease's deadline. Best effort: it expires anyway."""
        pre, self.pending = self.pending, None
        if pre is None or not pre.done.wait(timeout_s) or pre.lease is None:
            return
        try:
            self.client.release(pre.lease.lease_id)
            log.info("lease %d (fetched ahead, not trained) given back", pre.lease.lease_id)
        except (httpx.TransportError, CoordinatorError) as exc:
            log.info("lease %d (fetched ahead, not trained) not given back (%s); it expires at its deadline",
                     pre.lease.lease_id, why(exc))
