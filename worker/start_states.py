"""The start states of this worker's recent rounds, kept until the coordinator no longer wants them.

A round's upload commits to the state it started from (its SHA-256 and size in the upload's headers:
shared/algorithms/start_state.py). A spot-checked lease's acknowledgement then says
`start_state_wanted`, and the worker sends those bytes (PUT .../start-state): the coordinator replays
the round from them. The state is written here at the round's start, before the first step, so a
restart mid-round or after the upload still has it; a wanted one is marked so it survives pruning
and goes first at the next start.

    state_dir/runs/<run key>/starts/<lease id>.st       the state's bytes
    state_dir/runs/<run key>/starts/<lease id>.wanted   its check asked for it (not sent yet)
    state_dir/runs/<run key>/starts/<lease id>.ex       a sparta round's: where it applied its
                                                        corrections (sent with the state)
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import httpx

from shared import protocol
from shared.algorithms.registry import ALGORITHMS
from shared.algorithms.spotcheck import format_applied
from shared.files import atomic_write
from worker.answers import CoordinatorError, is_transient, why

log = logging.getLogger(__name__)

# Refusals after which a wanted state is dropped: no longer wanted, or not the committed bytes.
DROPPED = (403, 404, 409, 410, 413)


class StartStates:
    KEEP = 4  # rounds whose states stay without being asked for: the round uploading and the next two

    def __init__(self, folder: Path) -> None:
        self.dir = folder
        self._digests: dict[int, tuple[str, int]] = {}

    def _path(self, lease_id: int, suffix: str = ".st") -> Path:
        return self.dir / f"{int(lease_id):010d}{suffix}"

    def keep(self, lease_id: int, blob: bytes) -> None:
        """Write a round's start state (before its first step); older unwanted ones beyond KEEP go."""
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self._path(lease_id), blob)
        self._digests[lease_id] = (hashlib.sha256(blob).hexdigest(), len(blob))
        kept = sorted(self._ids(".st"))
        wanted = set(self._ids(".wanted"))
        for old in [i for i in kept if i not in wanted][:-self.KEEP]:
            self.drop(old)

    def _ids(self, suffix: str) -> list[int]:
        if not self.dir.is_dir():
            return []
        return [int(p.stem) for p in self.dir.glob(f"*{suffix}") if p.stem.isdigit()]

    def commitment(self, lease_id: int) -> tuple[str, int] | None:
        """(SHA-256, size) of the lease's start state, None when none was kept (a round resumed from an
        older worker's files, or a sparta round)."""
        if lease_id not in self._digests:
            try:
                blob = self._path(lease_id).read_bytes()
            except FileNotFoundError:
                return None
            self._digests[lease_id] = (hashlib.sha256(blob).hexdigest(), len(blob))
        return self._digests[lease_id]

    def note_exchanges(self, lease: protocol.Lease, result) -> None:
        """A round with exchanges (sparta), at its end: where its corrections were applied (result:
        trainer.RoundResult), sent with its state if asked for."""
        if ALGORITHMS[lease.algorithm].exchanges and self._path(lease.lease_id).exists():
            text = format_applied(result.resumed_at, result.exchanges_applied_at)
            atomic_write(self._path(lease.lease_id, ".ex"), text.encode())

    def want(self, lease_id: int) -> None:
        if self._path(lease_id).exists():
            atomic_write(self._path(lease_id, ".wanted"), b"")
        else:
            log.warning("lease %d: its spot-check asks for the round's start state, which is gone", lease_id)

    def wanted(self) -> list[int]:
        return sorted(self._ids(".wanted"))

    def drop(self, lease_id: int) -> None:
        self._path(lease_id, ".wanted").unlink(missing_ok=True)
        self._path(lease_id, ".ex").unlink(missing_ok=True)
        self._path(lease_id).unlink(missing_ok=True)
        self._digests.pop(lease_id, None)

    def send_wanted(self, client) -> int:
        """Send every wanted state (client: worker.client.CoordinatorClient); returns how many went.
        A refusal that says it is no longer wanted drops it; a transient failure leaves it for later."""
        sent = 0
        for lease_id in self.wanted():
            try:
                blob = self._path(lease_id).read_bytes()
            except FileNotFoundError:
                self.drop(lease_id)
                continue
            try:
                applied = self._path(lease_id, ".ex").read_text()
            except FileNotFoundError:
                applied = None
            try:
                client.upload_start_state(lease_id, blob, exchanges_applied=applied)
            except CoordinatorError as exc:
                if exc.status in DROPPED:
                    log.warning("lease %d: start state not taken (%s); dropped", lease_id, why(exc))
                    self.drop(lease_id)
                    continue
                if not is_transient(exc):
                    raise
                log.info("lease %d: start state not sent yet (%s); trying again later", lease_id, why(exc))
                return sent
            except httpx.TransportError as exc:  # the coordinator is away
                log.info("lease %d: start state not sent yet (%r); trying again later", lease_id, exc)
                return sent
            log.info("lease %d: start state sent for its spot-check (%d bytes)", lease_id, len(blob))
            self.drop(lease_id)
            sent += 1
        return sent
