"""Reaching the coordinator: /healthz asked until it answers (in this worker's API version), the
worker's token (registered once per run, kept in tokens.json: worker/caches.py), and the waits
after a failure that waiting may mend (no connection, a timeout, 5xx, 429).
"""

from __future__ import annotations

import logging

import httpx

from shared import protocol
from worker.caches import TokenStore
from worker.client import CoordinatorClient, CoordinatorError, backoff_delay, is_transient, why
from worker.control import StopFlag
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class Connection:
    def __init__(self, client: CoordinatorClient, settings: WorkerSettings, tokens: TokenStore, stop: StopFlag, *,
                 device_type: str) -> None:
        self.client, self.settings, self.tokens, self.stop = client, settings, tokens, stop
        self.device_type = device_type
        self.registered = False

    def wait(self, attempt: int, exc: BaseException) -> None:
        """Back off after a transient failure (as long as the coordinator's Retry-After said, when
        it said). The first Ctrl-C ends the wait."""
        hint = getattr(exc, "retry_after", None)
        delay = hint if hint is not None else backoff_delay(attempt)
        log.warning("coordinator %s unreachable (%s), retrying in %.1fs", self.settings.coordinator, why(exc), delay)
        self.stop.event.wait(delay)

    def wait_until_up(self) -> protocol.Health | None:
        """/healthz, asked until it answers; None when stopped while waiting. RuntimeError when the
        coordinator speaks another API version."""
        attempt = 0
        while not self.stop.event.is_set():
            try:
                health = self.client.health(max_retries=0)
            except (httpx.TransportError, CoordinatorError) as exc:
                if not is_transient(exc):
                    raise
                self.wait(attempt, exc)
                attempt += 1
                continue
            if health.api_version != protocol.API_VERSION:
                raise RuntimeError(f"coordinator speaks API v{health.api_version}, this worker "
                                   f"v{protocol.API_VERSION}: upgrade idletrain")
            return health
        return None

    def ensure_token(self) -> None:
        """The client's token: --token, else the one kept for (coordinator, run), else a new
        registration (kept). Once per process."""
        if self.registered:
            return
        s = self.settings
        token = s.token or self.tokens.get(s.coordinator, s.run)
        if token is None:
            reg = self.client.register(s.run, protocol.RegisterRequest(
                name=s.name, team=s.team, device=self.device_type, join_key=s.join_key))
            self.tokens.put(s.coordinator, s.run, reg.worker_id, reg.token)
            token = reg.token
            log.info("registered with run %s as worker %d", s.run, reg.worker_id)
        self.client.token = token
        self.registered = True
