"""The shell around worker/policy.py: while the worker runs, it decides whether it may train, makes
it wait when not, and keeps the status file and the display current.

One background thread samples the host (worker/host.py) every `check_every_s` and publishes the
status; the training thread asks check() between rounds and at every local step (a stat of the
control file and the pure policy over the latest sample: microseconds), so a pause takes effect
within one check interval plus one step.

    wait_between_rounds()  blocks before a lease (or a saved round's resume) while the policy says no
    hold()                 the trainer's gate between local steps: saves the round, then waits in
                           place for at most policy.hold_limit_s() of the lease's remaining time,
                           then lets the round go (RoundSuspended; it resumes from its save)
    awake()                the context a round runs in: with --keep-awake, the machine's sleep held
                           off (worker/awake.py), else nothing
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

from shared import protocol
from worker.awake import KeepAwake
from worker.control import ControlFile
from worker.host import HostMonitor, HostReading
from worker.policy import Rules, Verdict, decide, format_duration, hold_limit_s, next_utc_day
from worker.throttle import DailyTransfer

log = logging.getLogger(__name__)


class Governor:
    def __init__(self, rules: Rules, *, control: ControlFile, transfer: DailyTransfer,
                 monitor: HostMonitor | None = None, check_every_s: float = 2.0,
                 publish: Callable[[], None] = lambda: None, on_resume: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = lambda: datetime.now(UTC),
                 keep_awake: KeepAwake | None = None) -> None:
        self.rules = rules
        self.control = control
        self.transfer = transfer
        self.monitor = monitor if monitor is not None and monitor.needed else None
        self.check_every_s = check_every_s
        self.publish = publish
        self.on_resume = on_resume
        self.clock, self.wall = clock, wall
        self.next_round_bytes = 0  # what the last round moved: the daily cap's estimate for the next one
        self.paused: Verdict | None = None  # what holds the worker, while it waits
        self.paused_since: datetime | None = None
        self._keep_awake = keep_awake if keep_awake is not None else KeepAwake(rules.keep_awake)
        self._reading = HostReading()
        self._noted = False
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the background thread ------------------------------------------------------------------

    def start(self) -> None:
        self.sample()
        self._halt.clear()
        self._thread = threading.Thread(target=self._loop, name="idletrain-governor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _loop(self) -> None:
        while not self._halt.wait(self.check_every_s):
            try:
                self.sample()
                self.publish()
            except Exception:  # noqa: BLE001 -- a failing probe must not end the thread that pauses training
                log.exception("checking the host failed; trying again in %.0f s", self.check_every_s)

    def sample(self) -> None:
        if self.monitor is not None:
            self._reading = self.monitor.read()

    # -- the policy -----------------------------------------------------------------------------

    def check(self, *, in_round: bool) -> Verdict:
        now = self.wall()
        conditions = self._reading.conditions(
            paused_by_user=self.control.paused(), transfer_today_bytes=self.transfer.used_today(),
            next_round_bytes=0 if in_round else self.next_round_bytes, in_round=in_round,
            to_next_day_s=(next_utc_day(now) - now).total_seconds(),
            local_time=now.astimezone() if self.rules.hours is not None else None)
        verdict = decide(self.rules, conditions)
        if verdict.note and not self._noted:
            self._noted = True
            log.warning("%s", verdict.note)
        return verdict

    def awake(self) -> KeepAwake:
        """`with governor.awake():` around a round, on the thread that trains it."""
        return self._keep_awake

    def _poll_s(self) -> float:
        return min(1.0, self.check_every_s)

    def _pause(self, verdict: Verdict, where: str) -> None:
        if self.paused is None:
            self.paused_since = self.wall()
            log.info("pausing%s: %s", where, verdict.reason)
        else:  # a round let go while paused: the same pause goes on between rounds
            self._still_paused(verdict)
        self.paused = verdict
        self.publish()

    def _still_paused(self, verdict: Verdict) -> None:
        if self.paused is not None and verdict.kind != self.paused.kind:
            log.info("still paused: %s", verdict.reason)
        self.paused = verdict

    def _go_on(self) -> None:
        since = self.paused_since
        took = format_duration((self.wall() - since).total_seconds()) if since else "a while"
        log.info("going on after %s paused", took)
        self.paused = self.paused_since = None
        self.on_resume()
        self.publish()

    def wait_between_rounds(self, stop: threading.Event) -> bool:
        """Return at once when training may go on; else wait until it may (True) or until stopped (False)."""
        verdict = self.check(in_round=False)
        if verdict.train:
            return True
        self._pause(verdict, "")
        while not stop.wait(self._poll_s()):
            verdict = self.check(in_round=False)
            if verdict.train:
                self._go_on()
                return True
            self._still_paused(verdict)
        return False

    def hold(self, lease: protocol.Lease, step: int, save: Callable[[], None], stop: threading.Event) -> bool:
        """The trainer's gate after local step `step`: True to go on (at once, or after a pause), False
        to let the round go (stopped: saved first; paused past the hold limit, or stopped while paused)."""
        if stop.is_set():  # Ctrl-C (or SIGTERM): the round waits on disk, from this step
            save()
            log.info("lease %d: stopped after step %d/%d (saved: the round resumes there at the next start, "
                     "while its lease still stands)", lease.lease_id, step, lease.inner.steps)
            return False
        verdict = self.check(in_round=True)
        if verdict.train:
            return True
        save()  # first: a kill or a long pause from here loses nothing
        deadline = lease.deadline if lease.deadline.tzinfo else lease.deadline.replace(tzinfo=UTC)
        left_s = (deadline - self.wall()).total_seconds()
        limit_s = hold_limit_s(left_s)
        self._pause(verdict, f" lease {lease.lease_id} after step {step}/{lease.inner.steps} (saved)")
        t0 = self.clock()
        while not stop.wait(self._poll_s()):
            verdict = self.check(in_round=True)
            if verdict.train:
                self._go_on()
                return True
            self._still_paused(verdict)
            if self.clock() - t0 > limit_s:
                log.warning("lease %d: paused longer than half the %s it had left; letting it go (its round "
                            "resumes from step %d when training may go on, and is delivered late if the "
                            "coordinator still takes it)", lease.lease_id, format_duration(left_s), step)
                return False
        log.info("lease %d: stopping while paused; the round resumes from step %d at the next start",
                 lease.lease_id, step)
        return False
