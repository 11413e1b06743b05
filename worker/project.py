"""Following a whole coordinator (a project) instead of one run: `worker run` without --run (or
--run auto). The worker lists the coordinator's active runs (GET /runs?state=active, public), trains
the one of highest priority it can hold (its model within this machine's --max-params, its join key
known when it needs one), and moves on when that run is over (410: finished; 404: gone), when it
stops being active (paused), or when another run it can hold gets a higher priority; each run
keeps its own token and state (worker/caches.py, worker/state.py). With no run to train it waits,
asking again every few minutes; it never exits for want of work.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import httpx
from pydantic import ValidationError

from shared import protocol
from shared.config import RunConfig
from worker import memory
from worker.client import CoordinatorClient, CoordinatorError, InvalidAnswer, why
from worker.control import StopFlag
from worker.loop import Worker
from worker.settings import WorkerSettings
from worker.trainer import LocalTrainer, pick_device

log = logging.getLogger(__name__)

AUTO = "auto"  # --run auto: follow the coordinator's runs (as no --run does)


def follows_project(settings: WorkerSettings) -> bool:
    return settings.run is None or settings.run == AUTO


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    priority: int


def pick(runs: list[protocol.RunSummary], *, fits: Callable[[protocol.RunSummary], str | None],
         has_join_key: bool, skip: dict[str, str]) -> tuple[Candidate | None, list[str]]:
    """The active run of highest priority (the older run on ties) that this worker can train, and why
    each one above it was passed over. `fits(run)`: None, or why its model is too large here;
    `skip`: run name -> why it is passed over for now (it refused this worker, or is over)."""
    passed: list[str] = []
    for run in sorted((r for r in runs if r.state == "active"), key=lambda r: (-r.priority, r.created_at)):
        why_not = skip.get(run.name)
        if why_not is None and run.join_key_required and not has_join_key:
            why_not = "it needs a join key (--join-key)"
        if why_not is None:
            why_not = fits(run)
        if why_not is None:
            return Candidate(run.name, run.priority), passed
        passed.append(f"run {run.name} (priority {run.priority}): {why_not}")
    return None, passed


class Project:
    """The choice of run for a worker following the coordinator; `follow` trains until stopped."""

    RECHECK_S = 180.0  # how often the runs are listed again: for a better run, or for any run at all
    SKIP_S = 1800.0  # a run that refused this worker is passed over this long

    def __init__(self, settings: WorkerSettings, *, stop: StopFlag, client: CoordinatorClient,
                 max_params: int) -> None:
        self.settings, self.stop, self.client, self.max_params = settings, stop, client, max_params
        self.skipped: dict[str, tuple[str, float]] = {}  # run -> (why, until: time.monotonic())
        self._fit_cache: dict[str, str | None] = {}

    def _skip(self) -> dict[str, str]:
        now = time.monotonic()
        self.skipped = {k: v for k, v in self.skipped.items() if v[1] > now}
        return {k: why_not for k, (why_not, _) in self.skipped.items()}

    def fits(self, run: protocol.RunSummary) -> str | None:
        """None when a round of the run fits this machine's --max-params, else why not (from its public config)."""
        if run.n_params > self.max_params:
            return f"its {run.n_params:,} parameters are over this worker's --max-params {self.max_params:,}"
        if run.name not in self._fit_cache:
            try:
                cfg = RunConfig.model_validate(self.client.run_config(run.name))
            except (ValidationError, ValueError) as exc:
                return f"its config does not read ({exc.__class__.__name__})"
            rows = cfg.inner.micro_batch_size or 1
            need = memory.min_max_params(cfg.model, batch_size=rows)
            self._fit_cache[run.name] = (None if need <= self.max_params else
                                         f"a round needs --max-params >= {need:,}, this worker has {self.max_params:,}")
        return self._fit_cache[run.name]

    def choose(self) -> Candidate | None:
        """The run to train now (None: none this worker can train), logging what was passed over."""
        runs = self.client.runs(state="active")
        choice, passed = pick(runs, fits=self.fits, has_join_key=self.settings.join_key is not None,
                              skip=self._skip())
        for line in passed:
            log.info("passing over %s", line)
        return choice

    def better_than(self, current: Candidate) -> Callable[[], bool]:
        """The worker's `leave_when`: every RECHECK_S, whether another run should be trained instead
        (the current one is no longer active, or one of higher priority came)."""
        due = [time.monotonic() + self.RECHECK_S]

        def check() -> bool:
            if time.monotonic() < due[0]:
                return False
            due[0] = time.monotonic() + self.RECHECK_S
            try:
                choice = self.choose()
            except (httpx.TransportError, CoordinatorError, InvalidAnswer) as exc:
                log.debug("runs not listed (%s); staying with run %s", why(exc), current.name)
                return False
            if choice is None or choice.name == current.name:
                return False
            log.info("moving from run %s (priority %d) to run %s (priority %d)", current.name, current.priority,
                     choice.name, choice.priority)
            return True

        return check

    def left(self, run: str, exc: CoordinatorError) -> None:
        """The worker left `run` because of `exc` (the run is over, or refused this worker)."""
        if exc.status == 410:
            log.info("run %s finished; looking for the next run to train", run)
        else:
            log.warning("run %s refused this worker (%s); passing it over for %.0f min", run, why(exc),
                        self.SKIP_S / 60)
        self.skipped[run] = (f"it answered {why(exc)}", time.monotonic() + self.SKIP_S)

    def wait_for_runs(self, exc: BaseException | None) -> None:
        if exc is None:
            log.info("no active run on %s that this worker can train; asking again in %.0f min",
                     self.settings.coordinator, self.RECHECK_S / 60)
        else:
            log.warning("the coordinator's runs could not be listed (%s); asking again in %.0f min", why(exc),
                        self.RECHECK_S / 60)
        self.stop.event.wait(self.RECHECK_S)


def follow(settings: WorkerSettings, *, stop: StopFlag, trainer: LocalTrainer | None = None) -> int:
    """Train the coordinator's runs, one after another, until stopped (or settings.max_rounds in all);
    returns the rounds delivered. `trainer`: one to train every run with (kept open), else each run's
    worker makes its own."""
    if settings.token is not None:
        raise RuntimeError("--token is the token of one run: give that run with --run, or leave --token out (a "
                           "worker following the coordinator registers with each run it trains)")
    max_params = memory.worker_max_params(settings.max_params, settings.max_memory,
                                          lambda: memory.probe(pick_device(settings.device)))
    lister = CoordinatorClient(settings.coordinator, timeout_s=settings.request_timeout_s, max_retries=2)
    project = Project(settings, stop=stop, client=lister, max_params=max_params)
    rounds = 0
    try:
        while not stop.event.is_set() and (settings.max_rounds is None or rounds < settings.max_rounds):
            try:
                refused = lister.agree_version(lister.health())  # the API version to list runs in
                if refused is not None:
                    raise refused
                choice = project.choose()
            except (httpx.TransportError, CoordinatorError, InvalidAnswer) as exc:
                project.wait_for_runs(exc)
                continue
            if choice is None:
                project.wait_for_runs(None)
                continue
            log.info("training run %s (priority %d)", choice.name, choice.priority)
            left = None if settings.max_rounds is None else settings.max_rounds - rounds
            worker = Worker(settings.model_copy(update={"run": choice.name, "max_params": max_params,
                                                        "max_rounds": left}), stop=stop, trainer=trainer)
            worker.leave_when = project.better_than(choice)
            try:
                rounds += worker.run()
            finally:
                if trainer is None:
                    worker.trainer.close()
                worker.client.close()
            if worker.left is not None:
                project.left(choice.name, worker.left)
    finally:
        lister.close()
    return rounds
