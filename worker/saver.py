"""When the worker writes its local state (worker/state.py's StateStore holds the files).

The trainer's state: every checkpoint_every_steps local steps and at each round's end. A finished
round's delta: before its upload, forgotten once the coordinator answered it. With overlap the
end-of-round state is written on a background thread while the next round starts; every later
save and every read of the state on disk waits for it first. A disk that fails (full, read-only)
costs the resume, never the round: a warning, and the worker goes on.
"""

from __future__ import annotations

import logging
import threading

from shared import protocol
from worker.state import StateStore, TrainerState
from worker.trainer import LocalTrainer

log = logging.getLogger(__name__)


class Saver:
    def __init__(self, store: StateStore, trainer: LocalTrainer, *, overlap: bool) -> None:
        self.store, self.trainer, self.overlap = store, trainer, overlap
        self._thread: threading.Thread | None = None  # the end-of-round state on its way to disk (overlap)

    def save(self, state: TrainerState) -> None:
        """Write `state` now (the trainer's checkpoint callable)."""
        self.join()  # in order: an earlier state written in the background goes first
        self.write(state)

    def write(self, state: TrainerState) -> None:
        try:
            self.store.save(state)
        except OSError as exc:  # a full disk costs the resume, not the round
            log.warning("cannot save the local training state to %s (%s); going on without", self.store.dir, exc)

    def save_trainer(self) -> None:
        """The trainer's state between rounds. With overlap it is written on a background thread (the
        copy is taken here, so the next round's training does not change it)."""
        if not self.trainer.has_state():
            return
        state = self.trainer.export_state()
        if not self.overlap:
            self.save(state)
            return
        self.join()
        self._thread = threading.Thread(target=self.write, args=(state,), name="idletrain-save", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait for the state written in the background, if any."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def save_unsent(self, lease: protocol.Lease, body: bytes) -> None:
        try:
            self.store.save_unsent(lease, body)
        except OSError as exc:
            log.warning("cannot save lease %d's delta to %s (%s); uploading it anyway",
                        lease.lease_id, self.store.dir, exc)

    def forget_unsent(self, lease_id: int) -> None:
        try:
            self.store.clear_unsent(lease_id)
        except OSError as exc:
            log.warning("cannot remove lease %d's delta from %s (%s)", lease_id, self.store.dir, exc)
