"""A round's delta on its way to the coordinator, and the answer settled.

A finished round's delta is saved first (worker/saver.py) and forgotten once the coordinator
answered it: an acknowledgement counts the round; a refusal of that delta for good (its lease is
gone, its bytes are refused: client.DELTA_REFUSED) puts the delta's content back into the
trainer's residual, so refused work still moves the model later; a transient failure, or a
refusal only someone's action mends (client.Blocked: over the upload cap, a token refused), leaves
it on disk for worker/recovery.py to deliver once it may.

Overlap (settings.overlap, on by default): the upload runs on a background thread (one at a time:
a round that ends while the previous upload still runs waits for it) while the worker moves on.
The upload thread only sends and forgets the file; the loop settles its answer between rounds, on
the training thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import httpx

from shared import codec, protocol
from shared.algorithms.registry import ALGORITHMS
from shared.algorithms.compress import delta_to_tensors
from worker.client import (DELTA_REFUSED, REDELIVERY_REFUSED, Blocked, CoordinatorClient, CoordinatorError,
                           is_transient, why)
from worker.ledger import OwnDeltas
from worker.progress import Progress
from worker.saver import Saver
from worker.start_states import StartStates
from worker.state import StateStore
from worker.trainer import LocalTrainer, RoundResult

log = logging.getLogger(__name__)


class Upload:
    """One delta's upload on a background thread: `send()` returns the acknowledgement or the
    refusal; anything it raises (a transient failure, a kill in a test) is kept for the settling."""

    def __init__(self, lease: protocol.Lease, result: RoundResult,
                 send: Callable[[], protocol.DeltaAccepted | CoordinatorError]) -> None:
        self.lease, self.result = lease, result
        self.outcome: protocol.DeltaAccepted | CoordinatorError | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(send,), daemon=True,
                                        name=f"idletrain-upload-{lease.lease_id}")
        self._thread.start()

    def _run(self, send) -> None:
        try:
            self.outcome = send()
        except BaseException as exc:  # noqa: BLE001 -- handed to the training thread, which re-raises it
            self.error = exc
        finally:
            self.done.set()


class Delivery:
    """The worker's deltas on their way: `rounds` counts those acknowledged by this process,
    `inflight` is the one uploading in the background."""

    def __init__(self, client: CoordinatorClient, store: StateStore, saver: Saver, trainer: LocalTrainer,
                 progress: Progress, own: OwnDeltas) -> None:
        self.client, self.store, self.saver, self.trainer = client, store, saver, trainer
        self.progress, self.own = progress, own
        self.starts = StartStates(store.dir / "starts")
        self.rounds = 0
        self.inflight: Upload | None = None

    def uploading(self) -> bool:
        """An upload is in flight and not answered yet."""
        return self.inflight is not None and not self.inflight.done.is_set()

    def deliver(self, lease: protocol.Lease, body: bytes, *,
                redelivery: bool = False) -> protocol.DeltaAccepted | None:
        """Upload a saved delta; forget it once answered. None when refused for good (its content
        goes back to the residual); transient failures and Blocked refusals raise and leave it on disk."""
        try:
            ack = self.client.upload_delta(lease.lease_id, body, start_state=self.starts.commitment(lease.lease_id))
        except CoordinatorError as exc:
            if exc.status not in (REDELIVERY_REFUSED if redelivery else DELTA_REFUSED):
                raise
            log.warning("lease %d: delta refused (%s); taking a new lease", lease.lease_id, why(exc))
            # first: a crash now loses this delta's content, never counts it twice
            self.saver.forget_unsent(lease.lease_id)
            self.take_back(lease, body)
            return None
        self.saver.forget_unsent(lease.lease_id)
        return ack

    def acked(self, lease: protocol.Lease, ack: protocol.DeltaAccepted) -> None:
        """A delta delivered on the training thread: the round counts."""
        self.own.acked(lease.lease_id, ack)
        self.rounds += 1
        self.progress.utilisation.acked()
        self.checked(lease, ack)

    def checked(self, lease: protocol.Lease, ack: protocol.DeltaAccepted) -> None:
        """The acknowledgement asks for the round's start state (a spot-check): send it now, on the
        training thread (a transient failure leaves it marked, sent at the next acknowledgement or start)."""
        if ack.start_state_wanted:
            self.starts.want(lease.lease_id)
        self.starts.send_wanted(self.client)  # nothing when nothing is wanted

    def take_back(self, lease: protocol.Lease, body: bytes) -> None:
        """A refused delta's content goes back to the residual (on the training thread, between
        rounds: another round may have trained since, so by its bytes), and to disk: into the saved
        round's residual when a round waits there to resume (set aside, or interrupted), else with
        the trainer's state."""
        self.own.refused(lease.lease_id)
        try:
            self.trainer.undeliverable_body(body)
            self.saver.join()
            saved = self.store.load()
            if saved is None or saved.round is None:
                self.saver.save_trainer()
            elif saved.residual:
                schema = {n: tuple(t.shape) for n, t in saved.params.items()}
                for name, sent in delta_to_tensors(codec.decode(body, schema=schema), schema).items():
                    saved.residual[name] += sent
                self.saver.save(saved)
        except (ValueError, KeyError) as err:
            log.warning("lease %d: the refused delta does not fit the model (%s)", lease.lease_id, err)

    # -- the upload in the background -----------------------------------------------------------

    def start(self, lease: protocol.Lease, result: RoundResult) -> None:
        """Upload a saved delta on a background thread. The thread touches only the client and the
        delta's file; settle() handles the answer on the training thread."""
        def send() -> protocol.DeltaAccepted | CoordinatorError:
            try:
                ack = self.client.upload_delta(lease.lease_id, result.body,
                                               start_state=self.starts.commitment(lease.lease_id))
            except CoordinatorError as exc:
                if exc.status not in DELTA_REFUSED:
                    raise
                self.saver.forget_unsent(lease.lease_id)  # first: a crash now loses its content, never counts it twice
                return exc
            self.saver.forget_unsent(lease.lease_id)
            self.progress.utilisation.acked()  # the time of the acknowledgement, not of its settling
            return ack

        self.inflight = Upload(lease, result, send)

    def settle(self) -> None:
        """Wait for the upload in flight (the wait is not compute) and act on its answer: count the
        round, or take a refused delta's content back into the residual. Re-raises its failure (a
        transient one leaves the delta on disk for recovery)."""
        up = self.inflight
        if up is None:
            return
        if not up.done.is_set():
            phase, reason = self.progress.phase, self.progress.wait_reason
            self.progress.set_phase("uploading")
            t0 = self.progress.utilisation.clock()
            up.done.wait()
            self.progress.utilisation.add_upload_wait(self.progress.utilisation.clock() - t0)
            self.progress.set_phase(phase, reason)
        self.inflight = None
        if up.error is not None:
            raise up.error
        outcome = up.outcome
        if isinstance(outcome, CoordinatorError):
            log.warning("lease %d: delta refused (%s); its content goes back to the residual", up.lease.lease_id,
                        why(outcome))
            self.take_back(up.lease, up.result.body)
            return
        self.own.acked(up.lease.lease_id, outcome)
        self.rounds += 1
        log_round(up.lease, up.result, outcome)
        self.checked(up.lease, outcome)

    def finish(self) -> None:
        """Stopping: settle the upload in flight; a transient failure leaves its delta on disk."""
        up = self.inflight
        if up is None:
            return
        try:
            self.settle()
        except (httpx.TransportError, CoordinatorError) as exc:
            if not (is_transient(exc) or isinstance(exc, Blocked)):
                raise
            log.warning("lease %d: delta not delivered (%s); it stays on disk and goes first at the next start",
                        up.lease.lease_id, why(exc))


def log_round(lease: protocol.Lease, result: RoundResult, ack: protocol.DeltaAccepted) -> None:
    """The line a delivered round leaves in the log (tests/e2e/test_churn.py reads it)."""
    exchanged = ""
    if ALGORITHMS[lease.algorithm].exchanges:
        exchanged = (f", {result.exchanges} exchanges ({result.exchange_bytes_up / 1024:.1f} KB up, "
                     f"{result.exchange_bytes_down / 1024:.1f} KB down, {result.exchanges_failed} failed, "
                     f"{result.exchanges_skipped} skipped)")
    resumed = f" (resumed at step {result.resumed_at})" if result.resumed_at else ""
    log.info("lease %d: shard %d from v%d, %d steps%s, local training loss %.3f -> %.3f (on its batches; the "
             "coordinator's eval loss is on held-out text), %.0f tok/s, sent %.1f KB -> v%d%s",
             lease.lease_id, lease.shard_id, lease.base_version, len(result.losses), resumed, result.losses[0],
             result.losses[-1], result.tokens / max(result.seconds, 1e-9), len(result.body) / 1024,
             ack.will_merge_into, exchanged)
