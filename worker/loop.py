"""The worker's main loop: lease -> base model and shard -> train (exchanging, for sparta) -> save
-> deliver, until told to stop. Each stage has its module; this one runs them in order:

    connection.py the coordinator reached (/healthz, API version, token), the waits after failures
    downloads.py  the lease checked, its base model kept current, its shard (cached, checked)
    trainer.py    the round's local steps (gated by the governor, the lease kept alive meanwhile)
    saver.py      the trainer's state and the round's delta written before anything is sent
    delivery.py   the delta uploaded (with overlap, in the background) and its answer settled
    prefetch.py   the next lease fetched near the end of a round (lease_ahead)
    ledger.py     this worker's own deltas that a new lease's base does not hold yet
    recovery.py   after a restart or an outage: unsent deltas first, then the interrupted round

Ctrl-C once: save the round after its current step, settle the upload, exit. Twice: at once (control.StopFlag).
A coordinator that is down or restarting is waited for, with backoff and jitter, at start and
between rounds; what was trained meanwhile waits on disk and is delivered first (recovery.py).
A refusal only someone's action mends is said once and waited out (connection.py); a finished run stops it.

Manners: before each round and between local steps the governor (worker/governor.py) asks the
policy (worker/policy.py) whether to train now: `idletrain worker pause`, the daily transfer cap,
battery, and with --when idle the user's presence or the CPU load. A pause mid-round saves the
round first, waits in place for a while, then lets the lease go and resumes the saved round when
training may go on (policy.hold_limit_s says why). The status file and display follow it all.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime

import httpx
import torch

from shared import protocol
from shared.algorithms.registry import ALGORITHMS
from worker import memory
from worker.caches import ShardCache, TokenStore
from worker.client import Blocked, CoordinatorClient, CoordinatorError, InvalidAnswer, backoff_delay, is_transient, why
from worker.connection import Connection
from worker.control import ControlFile, StatusFile, StopFlag, WorkerStatus
from worker.delivery import Delivery, log_round
from worker.downloads import Downloads
from worker.fit import FitOptions
from worker.governor import Governor
from worker.host import HostMonitor, HostReaders, system_readers
from worker.lease_keeper import LeaseKeeper
from worker.ledger import OwnDeltas
from worker.prefetch import Prefetched, Prefetcher
from worker.progress import Display, Progress, make_display
from worker.recovery import Recovery
from worker.saver import Saver
from worker.settings import WorkerSettings
from worker.state import RoundState, StateStore
from worker.throttle import DailyTransfer
from worker.trainer import LocalTrainer, RoundResult, RoundSuspended, pick_device

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, settings: WorkerSettings, *, stop: StopFlag | None = None,
                 client: CoordinatorClient | None = None, host: HostReaders | None = None,
                 display: Display | None = None, trainer: LocalTrainer | None = None) -> None:
        """`host` reads the machine (idle time, battery, load; default: this machine's probes),
        `display` shows progress (default: a live panel on a terminal, log lines elsewhere) and
        `trainer` trains the rounds (default: a LocalTrainer on settings.device)."""
        self.settings = settings
        self.stop = stop or StopFlag()
        self.shards = ShardCache(settings.state_dir / "cache")
        self.store = StateStore(settings.state_dir, settings.coordinator, settings.run)
        self.device = pick_device(settings.device)
        # The largest model this worker trains: --max-params, else what this machine's memory holds
        # now; within --max-memory.
        self.max_params = memory.worker_max_params(settings.max_params, settings.max_memory,
                                                   lambda: memory.probe(self.device))
        # Every answer is capped while it streams at the largest snapshot (or shard) that limit allows.
        self.client = client or CoordinatorClient(settings.coordinator, timeout_s=settings.request_timeout_s,
                                                  max_retries=settings.max_retries,
                                                  max_download_bytes=memory.download_cap_bytes(self.max_params))
        self.progress = Progress()
        self.connection = Connection(self.client, settings, TokenStore(settings.state_dir), self.stop,
                                     device_type=self.device.type, progress=self.progress, publish=self.publish)
        self.trainer = trainer if trainer is not None else LocalTrainer(self.device, fit=FitOptions(
            precision=settings.precision, micro_batch=settings.micro_batch,
            activation_checkpointing=settings.activation_checkpointing, max_params=self.max_params))
        self.suspended = False  # the last round was set aside while paused (RoundSuspended)
        self.leave_when: Callable[[], bool] | None = None  # following the coordinator (project.py): leave now?
        self.left: CoordinatorError | None = None  # the refusal that ended this run there (410: finished)
        # Ask for the next lease while a delta still uploads: only of a coordinator that keeps that
        # lease (None: as its /healthz says, `keeps_delivering_lease`; older coordinators do not say it).
        self.lease_ahead: bool | None = None
        # manners, progress, the control channel
        rules = settings.rules()
        self.transfer = DailyTransfer(settings.state_dir / "transfer.json", cap_bytes=rules.daily_transfer_bytes)
        self._moved_bytes = 0  # this process, all traffic: the daily cap's estimate of a round
        self.display = display if display is not None else make_display()
        self.status_file = StatusFile(self.store.dir)
        self._publish_lock = threading.Lock()
        self._started_at = datetime.now(UTC).isoformat(timespec="seconds")
        # the stages of a round around the trainer
        self.downloads = Downloads(self.client, self.shards, self.stop, self.trainer, max_params=self.max_params)
        self.own = OwnDeltas()
        self.saver = Saver(self.store, self.trainer, overlap=settings.overlap)
        self.delivery = Delivery(self.client, self.store, self.saver, self.trainer, self.progress, self.own)
        self.recovery = Recovery(self.store, self.saver, self.trainer, self.delivery, self.own)
        self.prefetch = Prefetcher(self.client, settings.run, self.downloads.prepare)
        monitor = None
        if rules.when == "idle" or rules.on_battery == "pause":
            monitor = HostMonitor(rules, host if host is not None else system_readers())
        self.governor = Governor(rules, control=ControlFile(self.store.dir), transfer=self.transfer,
                                 monitor=monitor, check_every_s=settings.check_every_s, publish=self.publish,
                                 on_resume=self.progress.restart_clock)

    @property
    def rounds(self) -> int:  # delivered (acknowledged) by this process
        return self.delivery.rounds

    @property
    def join_bytes(self) -> int | None:
        """What the first base model cost to download (0: version 0 built here; None: none yet)."""
        return self.downloads.join_bytes

    # -- progress and status --------------------------------------------------------------------

    def _moved(self, n: int) -> None:
        self._moved_bytes += n
        self.transfer.add(n)

    def status(self) -> WorkerStatus:
        """What status.json and the display show, now."""
        return self.progress.status(
            self.governor.paused, self.governor.paused_since, pid=os.getpid(), coordinator=self.settings.coordinator,
            run=self.settings.run, device=self.device.type, rounds=self.rounds, bytes_sent=self.client.sent_bytes,
            bytes_received=self.client.received_bytes, transfer_today_bytes=self.transfer.used_today(),
            transfer_cap_bytes=self.transfer.cap_bytes, started_at=self._started_at)

    def publish(self) -> None:
        """Write status.json and move the display on (the governor's thread every few seconds)."""
        with self._publish_lock:
            if self.store.dir.is_dir():
                self.status_file.write(self.status())
            self.display.tick()

    # -- one round ------------------------------------------------------------------------------

    def _round(self, lease: protocol.Lease, resume: RoundState | None = None,
               fetched: Prefetched | None = None) -> None:
        """Train one lease (or the rest of it), save, deliver (overlap: in the background, in turn)."""
        self.downloads.check(lease)
        self.progress.set_phase("downloading")
        if fetched is not None:  # fetched during the end of the round before
            inputs = fetched.base, fetched.tokens
        else:
            inputs = self.downloads.inputs(lease, resume=resume is not None)
        if inputs is None:
            if resume is not None:  # drop the round; keep what the trainer learnt
                self.saver.save_trainer()
            return
        result = self._train(lease, *inputs, resume=resume)
        if result is not None:
            self._send(lease, result)

    def _train(self, lease: protocol.Lease, base: dict[str, torch.Tensor] | None, tokens: torch.Tensor, *,
               resume: RoundState | None) -> RoundResult | None:
        """The round's local steps, the lease renewed meanwhile; None when it was set aside while
        paused (RoundSuspended: saved, it resumes when training may go on)."""
        self.progress.start_round(lease, context=lease.model.context,
                                  step=resume.step if resume is not None else 0)
        self.publish()
        keeper = LeaseKeeper(lease.lease_id, lease.deadline,
                             renew=lambda i, step: self.client.renew(i, step=step).deadline,
                             progress=lambda: self.progress.step)
        ahead = self.own.ahead_of(lease, base) if resume is None else None
        try:
            with keeper, self.governor.awake():  # renews the lease while the round moves; --keep-awake
                result = self.trainer.train_round(
                    lease, base, tokens, resume=resume, ahead=ahead,
                    exchange=lambda step, body: self.client.exchange(lease.lease_id, step, body),  # sparta
                    checkpoint=self.saver.save, checkpoint_every=self.settings.checkpoint_every_steps,
                    on_step=self._step_hook(lease),
                    on_start=lambda blob: self.delivery.starts.keep(lease.lease_id, blob),
                    gate=lambda step, save: self.governor.hold(lease, step, save, self.stop.event))
        except RoundSuspended as exc:
            if not self.stop.event.is_set():  # (stopping: the governor said so)
                log.info("lease %d: round set aside at step %d/%d (saved; it resumes when training may go on)",
                         lease.lease_id, exc.step, lease.inner.steps)
            self.progress.end_round()
            self.suspended = True
            return None
        self.progress.utilisation.add_compute(result.seconds)
        self.delivery.starts.note_exchanges(lease, result)  # sparta: where its corrections went
        return result

    def _step_hook(self, lease: protocol.Lease):
        """The trainer's on_step: progress, and the next lease's prefetch when it is due."""
        def on_step(step: int, loss: float) -> None:
            self.progress.on_step(step, loss)
            if self.prefetch.pending is None and self._should_prefetch(lease, step):
                self.prefetch.start(lease)

        return on_step

    def _should_prefetch(self, lease: protocol.Lease, step: int) -> bool:
        s = self.settings
        may = s.overlap and self._may_lease_ahead() and ALGORITHMS[lease.algorithm].leases_ahead
        if not may or self.stop.event.is_set():
            return False
        if self.delivery.uploading():
            return False  # asking now would give up the lease whose delta is still uploading
        if s.max_rounds is not None and self._rounds_counted() + 1 >= s.max_rounds:
            return False  # this round is the last
        return self.prefetch.due(lease, step, self.progress.steps_per_s())

    def _may_lease_ahead(self) -> bool:
        return bool(self.lease_ahead)

    def _rounds_counted(self) -> int:
        """Rounds delivered, and the one uploading (it counts unless refused)."""
        return self.rounds + (self.delivery.inflight is not None)

    def _send(self, lease: protocol.Lease, result: RoundResult) -> None:
        """Save the round's delta, then the trainer's state, and deliver the delta: in the background
        with overlap (once the previous upload is answered), else here."""
        if ALGORITHMS[lease.algorithm].leases_ahead:
            self.own.trained(lease.lease_id, result.body, self.trainer.last_sent or None)
        self.progress.set_phase("uploading")
        self.saver.save_unsent(lease, result.body)  # before the trainer's state: see Recovery.restore
        self.saver.save_trainer()
        if self.settings.overlap:
            self.progress.end_round()
            self.delivery.settle()  # at most one upload in flight: wait for the previous one
            self.delivery.start(lease, result)
            return
        try:
            ack = self.delivery.deliver(lease, result.body)
        finally:
            self.progress.end_round()
        if ack is None:
            return
        self.delivery.acked(lease, ack)
        log_round(lease, result, ack)

    def _recover(self) -> None:
        """Deliver what waits on disk, then finish the round that was interrupted (worker/recovery.py)."""
        rnd = self.recovery.recover()
        if rnd is None:
            return
        log.info("resuming lease %d at step %d/%d", rnd.lease.lease_id, rnd.step, rnd.lease.inner.steps)
        self._round(rnd.lease, resume=rnd)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> int:
        """Train until stopped or max_rounds; returns the number of rounds delivered."""
        if not self.store.lock():
            raise RuntimeError(f"another worker process is using {self.store.dir} for run {self.settings.run!r}; "
                               "give each worker on this machine its own --state-dir")
        try:
            self.client.set_transfer(upload_bytes_per_s=self.settings.upload_bytes_per_s(),
                                     download_bytes_per_s=self.settings.download_bytes_per_s(), meter=self._moved)
            self.governor.start()
            self.display.start(self.status)
            try:
                return self._run()
            finally:
                self.saver.join()
                self.progress.set_phase("stopped")
                self.governor.stop()
                self.display.stop()
                self.transfer.flush()
                self.publish()
        finally:
            self.store.unlock()

    def _start(self) -> bool:
        """The coordinator reached and of this API, the trainer restored; False when stopped meanwhile."""
        if self.settings.threads:
            torch.set_num_threads(self.settings.threads)
        health = self.connection.wait_until_up()
        if health is None:
            return False
        self.recovery.restore()
        self.delivery.starts.send_wanted(self.client)  # spot-checks that asked before a restart
        if self.lease_ahead is None:
            self.lease_ahead = bool(getattr(health, "keeps_delivering_lease", False))
        return True

    def _run(self) -> int:
        if not self._start():
            return self.rounds
        s = self.settings
        recover, failures = True, 0
        while not self.stop.event.is_set():
            moved_before = self._moved_bytes
            try:
                inflight = self.delivery.inflight
                if s.max_rounds is not None and self._rounds_counted() >= s.max_rounds:
                    if inflight is None:
                        break
                    self.delivery.settle()  # the last round's answer (a refusal means one more round)
                    continue
                if inflight is not None and (inflight.done.is_set() or not self._may_lease_ahead()
                                             or not self.governor.check(in_round=False).train):
                    # answered already, asking for a lease would give up the one still uploading, or a
                    # pause comes next (the round counts before it)
                    self.delivery.settle()
                    continue
                if not self.governor.wait_between_rounds(self.stop.event) or (self.leave_when and self.leave_when()):
                    break  # stopped, or (following the coordinator) another run is to be trained
                self.progress.set_phase("leasing")
                self.progress.utilisation.start()
                self.connection.ensure_token()
                if recover:
                    self._recover()
                    recover = False
                elif not self._next_round(moved_before):
                    continue  # no work now: asked again after the wait the coordinator said
                failures, self.connection.blocked_message = 0, None
            except Blocked as exc:  # only someone's action mends it: say so, keep what was trained, wait
                if exc.status == 410 or (self.leave_when is not None and exc.status in (401, 403, 404)):
                    self.left = exc  # the run over (a worker of one run stops), or refusing: following the
                    if self.leave_when is None:  # coordinator, another run may take this worker
                        log.info("%s", exc.message())
                    break
                self.connection.wait_blocked(exc)
                recover = True  # a delta kept on disk goes first
                continue
            except (httpx.TransportError, CoordinatorError) as exc:
                if not is_transient(exc):
                    raise
                # The coordinator is down or restarting: wait, then deliver what is on disk first.
                self.progress.set_phase("waiting", f"coordinator unreachable ({why(exc)})")
                self.connection.wait(failures, exc)
                failures, recover = failures + 1, True
                continue
            except InvalidAnswer as exc:
                self._refused(exc, failures)
                failures, recover = failures + 1, True
                continue
            if self.suspended:  # paused mid-round and let go: resume that round before any new lease
                self.suspended, recover = False, True
        self.delivery.finish()
        self.prefetch.release(self.settings.request_timeout_s)
        self.saver.join()
        self._log_utilisation()
        return self.rounds

    def _next_round(self, moved_before: int) -> bool:
        """Take the lease fetched ahead, or ask for one (keeping the one whose delta still uploads),
        and train it; False when the coordinator had no work (after waiting as long as it said)."""
        prefetched = self.prefetch.take()
        if prefetched is not None:
            lease, wait_s = prefetched.lease, 0.0
        elif self.delivery.inflight is not None:  # the coordinator keeps the lease still uploading
            lease, wait_s = self.client.lease(self.settings.run, keep=self.delivery.inflight.lease.lease_id)
        else:
            lease, wait_s = self.client.lease(self.settings.run)
        if lease is None:
            self.progress.set_phase("waiting", f"no work from the coordinator; asking again in {wait_s:.0f} s")
            self.stop.event.wait(wait_s)
            return False
        self._round(lease, fetched=prefetched)
        if not self.suspended:  # what a whole round moved: the daily cap's next estimate
            self.governor.next_round_bytes = self._moved_bytes - moved_before
        return True

    def _refused(self, exc: InvalidAnswer, failures: int) -> None:
        """A lease (or an answer) not in the protocol's form: refused before any of it is used.
        Asking again gives that lease up; a coordinator that keeps sending such is asked slower."""
        delay = backoff_delay(failures)
        log.warning("%s; refused, asking again in %.1f s", exc, delay)
        self.progress.set_phase("waiting", f"refused an invalid answer from the coordinator ({exc})")
        self.stop.event.wait(delay)

    def _log_utilisation(self) -> None:
        u = self.progress.utilisation
        if u.fraction() is not None:
            log.info("computing %.1f%% of %.1f s (first lease to last acknowledgement), %.1f s waiting for uploads",
                     100 * u.fraction(), u.wall_s(), u.upload_wait_s)


def run_worker(settings: WorkerSettings) -> int | None:
    """Run the worker until stopped. Under torchrun (WORLD_SIZE > 1) the processes are one worker:
    rank 0 runs this loop with a trainer that trains each round across every rank, the other ranks
    only follow it and never talk to the coordinator (worker/distributed.py). Returns the rounds
    delivered, or None on a follower rank."""
    from worker import distributed

    session = distributed.from_env(settings.device)  # None: one process, as without torchrun
    if session is not None and not session.leader:
        session.follow(threads=settings.threads)
        return None  # a follower delivers nothing itself: rank 0 counts the rounds
    try:
        stop = StopFlag()
        stop.install()
        trainer = distributed.LeadTrainer(session) if session is not None else None
        from worker.project import follow, follows_project
        if follows_project(settings):  # no --run: the coordinator's active runs, by priority
            return follow(settings, stop=stop, trainer=trainer)
        worker = Worker(settings, stop=stop, trainer=trainer)
        try:
            return worker.run()
        finally:
            worker.trainer.close()
            worker.client.close()
    finally:
        if session is not None:
            session.close()  # tells the other ranks to exit
