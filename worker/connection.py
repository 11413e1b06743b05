"""Reaching the coordinator: /healthz asked until it answers and serves an API version this worker
speaks (the highest of those is spoken from then on), the worker's token (registered once per run,
kept in tokens.json: worker/caches.py), the waits after a failure that waiting may mend (no
connection, a timeout, 408, 5xx, 429), and the waits after a refusal that only someone's action
mends (worker/answers.py's Blocked: an upload over the cap, no API version in common, a token
refused, a run gone). Such a wait says once what is
wrong and what to do, shows it in the status ("blocked"), asks the coordinator again every few
minutes, and ends at once on Ctrl-C; the worker never exits over it (under a service manager
that would restart it into the same refusal, retraining each time).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx

from shared import protocol
from worker.caches import TokenStore
from worker.answers import Blocked, NotACoordinator, UploadTooLarge, VersionRefused, version_refusal
from worker.client import CoordinatorClient, CoordinatorError, InvalidAnswer, backoff_delay, is_transient, why
from worker.control import StopFlag
from worker.progress import Progress
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class Connection:
    def __init__(self, client: CoordinatorClient, settings: WorkerSettings, tokens: TokenStore, stop: StopFlag, *,
                 device_type: str, progress: Progress | None = None, publish: Callable[[], None] | None = None) -> None:
        """`progress` and `publish` show a blocked wait in the status file and the display."""
        self.client, self.settings, self.tokens, self.stop = client, settings, tokens, stop
        self.device_type = device_type
        self.registered = False
        self.progress, self.publish = progress, publish
        self.blocked_message: str | None = None  # the last refusal said in the log (said once, not per recheck)

    @property
    def api_version(self) -> int:
        """The API version this worker's requests say (a client stand-in that does not say: this build's)."""
        return getattr(self.client, "api_version", protocol.API_VERSION)

    def agree_version(self, health: protocol.Health) -> VersionRefused | None:
        """The client speaks the highest API version it shares with the coordinator of this /healthz
        (CoordinatorClient.agree_version); why not, when they share none."""
        agree = getattr(self.client, "agree_version", None)  # (a client stand-in may speak one version only)
        return agree(health) if agree is not None else version_refusal(health, self.api_version)

    def wait(self, attempt: int, exc: BaseException) -> None:
        """Back off after a transient failure (as long as the coordinator's Retry-After said, when
        it said). The first Ctrl-C ends the wait."""
        hint = getattr(exc, "retry_after", None)
        delay = hint if hint is not None else backoff_delay(attempt)
        log.warning("coordinator %s unreachable (%s), retrying in %.1fs", self.settings.coordinator, why(exc), delay)
        self.stop.event.wait(delay)

    def wait_until_up(self) -> protocol.Health | None:
        """/healthz, asked until it answers and its API range holds a version this worker speaks (the
        highest of them spoken from then on; none: a blocked wait); None when stopped while waiting."""
        attempt = 0
        while not self.stop.event.is_set():
            try:
                health = self.client.health(max_retries=0)
            except (httpx.TransportError, CoordinatorError, InvalidAnswer) as exc:
                if isinstance(exc, httpx.TransportError | CoordinatorError) and is_transient(exc):
                    self.wait(attempt, exc)
                    attempt += 1
                else:  # a 404, an HTML page: not an idletrain coordinator, or not at that address
                    self.wait_blocked(exc if isinstance(exc, Blocked) else NotACoordinator(
                        self.settings.coordinator, why(exc)))
                continue
            refused = self.agree_version(health)
            if refused is not None:
                self.wait_blocked(refused)
                continue
            return health
        return None

    def wait_blocked(self, exc: Blocked) -> None:
        """Say what is wrong and what to do (once: a wait that ends in the same refusal says less),
        then wait until the coordinator may answer otherwise (asking it every exc.recheck_s) or the
        worker is stopped. What was trained stays: an undelivered delta is on disk, and the loop
        delivers it first after this wait."""
        message = exc.message()
        if message != self.blocked_message:
            log.error("%s", message)
            self.blocked_message = message
        else:
            log.info("still refused (%s); waiting", why(exc))
        if self.progress is not None:
            self.progress.set_phase("blocked", message)
        if self.publish is not None:
            self.publish()
        while not self.stop.event.wait(exc.recheck_s):
            if self._may_pass(exc):
                return

    def _may_pass(self, exc: Blocked) -> bool:
        """Whether asking again may now be answered otherwise: a version or an upload cap that
        /healthz says changed; any other refusal is asked again after its wait."""
        if not isinstance(exc, VersionRefused | UploadTooLarge):
            return True
        try:
            health = self.client.health(max_retries=0)
        except (httpx.TransportError, CoordinatorError, InvalidAnswer) as err:
            log.info("coordinator %s not answering (%s); still waiting", self.settings.coordinator, why(err))
            return False
        if isinstance(exc, VersionRefused):
            return self.agree_version(health) is None
        return exc.fits(health.max_upload_bytes)

    def ensure_token(self) -> None:
        """The client's token: --token, else the one kept for (coordinator, run), else a new
        registration (kept). Once per process."""
        if self.registered:
            return
        s = self.settings
        token = s.token or self.tokens.get(s.coordinator, s.run)
        if token is None:
            reg = self.client.register(s.run, protocol.RegisterRequest(
                name=s.name, team=s.team, device=self.device_type, join_key=s.join_key,
                contributor_key=s.contributor_key, team_key=s.team_key))
            self.tokens.put(s.coordinator, s.run, reg.worker_id, reg.token)
            token = reg.token
            log.info("registered with run %s as worker %d", s.run, reg.worker_id)
            if reg.contributor_key is not None:  # this machine claimed the name: the key adds the others
                log.warning("the name %r is yours in run %s; to add another machine under it, run that worker "
                            "with --contributor-key %s (keep it: it is shown only this once)",
                            s.name, s.run, reg.contributor_key)
        self.client.token = token
        self.registered = True
