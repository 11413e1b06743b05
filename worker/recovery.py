"""A worker that starts again, after a kill, a crash or a coordinator's outage, loses nothing
it had trained and sends nothing twice.

The trainer's state is saved under state_dir/runs/ (worker/state.py, worker/saver.py) every
checkpoint_every_steps local steps and at each round's end, and a finished round's delta is saved
before its upload and forgotten once the coordinator has answered it. A restarted worker first
delivers those deltas (the coordinator answers the same bytes the same way), then finishes the
round it was in, and only then asks for a new lease (asking gives the previous lease up).
"""

from __future__ import annotations

import logging

from shared.algorithms.registry import ALGORITHMS
from worker.delivery import Delivery
from worker.ledger import OwnDeltas
from worker.saver import Saver
from worker.state import RoundState, StateStore
from worker.trainer import LocalTrainer

log = logging.getLogger(__name__)


class Recovery:
    def __init__(self, store: StateStore, saver: Saver, trainer: LocalTrainer, delivery: Delivery,
                 own: OwnDeltas) -> None:
        self.store, self.saver, self.trainer, self.delivery, self.own = store, saver, trainer, delivery, own

    def restore(self) -> None:
        """At start: the trainer as it was between rounds (AdamW state, residual, sparta replica).
        A round in flight is left to recover(), which hands it back to be resumed."""
        saved = self.store.load()
        if saved is None:
            return
        unsent = {u.lease.lease_id for u in self.store.load_all_unsent()}
        if saved.round is not None and saved.round.lease.lease_id in unsent:
            # The round ended and its delta was saved, then the worker died before the end-of-round
            # state: the residual on disk is from before the round and would send again what the
            # delta carries, and the round must not be trained twice. Keep the rest.
            log.info("lease %d ended before the restart; its delta is delivered next", saved.round.lease.lease_id)
            saved.round, saved.residual = None, {}
            fixed = True
        elif saved.round is not None:
            return
        else:
            fixed = False
        try:
            self.trainer.restore_state(saved)
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            log.warning("local training state in %s does not fit (%s); starting afresh", self.store.dir, exc)
            self.store.clear()
            return
        if fixed:
            self.saver.save_trainer()
        log.info("restored the local training state (%d local steps so far)", self.trainer.steps_done)

    def recover(self) -> RoundState | None:
        """Before asking for a lease (which gives up the previous one): settle the upload in flight,
        deliver the deltas saved before a restart or an outage. Returns the round that was
        interrupted, to be finished next (None: none, or its lease no longer takes a delta)."""
        self.saver.join()
        saved = self.store.load()
        rnd = saved.round if saved is not None else None
        if rnd is not None:
            # restore first: a refused delta's content goes back into the residual the round resumes with
            try:
                self.trainer.restore_state(saved)
            except (ValueError, TypeError, KeyError, RuntimeError) as exc:
                log.warning("lease %d: the saved round does not fit (%s); dropping it", rnd.lease.lease_id, exc)
                self.store.clear()
                rnd = None
        self.delivery.settle()
        for unsent in self.store.load_all_unsent():
            lease = unsent.lease
            log.info("lease %d: delivering its delta saved before the interruption (%.1f KB)",
                     lease.lease_id, len(unsent.body) / 1024)
            ack = self.delivery.deliver(lease, unsent.body, redelivery=True)
            if ack is not None:
                if ALGORITHMS[lease.algorithm].leases_ahead:
                    self.own.saved(lease.lease_id, unsent.body)  # saved before a restart
                self.delivery.acked(lease, ack)
                log.info("lease %d: delivered -> v%d%s", lease.lease_id, ack.will_merge_into,
                         " (it had arrived before)" if ack.duplicate else "")
        if rnd is not None and not self.still_stands(rnd):
            self.saver.save_trainer()  # what the trainer learnt stays; the round goes
            return None
        return rnd

    def still_stands(self, rnd: RoundState) -> bool:
        """Ask the coordinator whether the interrupted round's lease still takes a delta before training
        on (a coordinator that cannot say: assume it does, the upload will tell)."""
        standing = self.delivery.client.lease_standing(rnd.lease.lease_id)
        if standing is None or standing.deliverable:
            return True
        log.info("lease %d: %s; its round saved at step %d/%d is dropped, and this worker takes a new lease",
                 rnd.lease.lease_id, standing.reason, rnd.step, rnd.lease.inner.steps)
        return False
