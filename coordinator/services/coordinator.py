"""Coordinator: builds the services, each with what it needs, and holds what they share."""

from __future__ import annotations

import logging

from coordinator import limits
from coordinator.db import Database
from coordinator.ratelimit import RateLimiter
from coordinator.services.downloads import DownloadService
from coordinator.services.exchanges import ExchangeService
from coordinator.services.leases import LeaseService
from coordinator.services.lifecycle import LifecycleService
from coordinator.services.live import LiveRuns
from coordinator.services.recovery import RecoveryService
from coordinator.services.reports import ReportService
from coordinator.services.runs import RunService
from coordinator.services.spotchecks import SpotCheckService
from coordinator.services.stats import StatsService
from coordinator.services.teams import TeamService
from coordinator.services.uploads import UploadService
from coordinator.services.workers import WorkerService
from coordinator.settings import CoordinatorSettings
from coordinator.storage import Storage
from coordinator.traffic import Traffic

log = logging.getLogger(__name__)


class Coordinator:
    """The database, the blob storage, the live models and the services over them, one per resource:
    `runs`, `recovery`, `workers`, `leases`, `downloads`, `uploads`, `exchanges`, `reports`, `lifecycle`,
    `stats`, `spotchecks`, `teams`."""

    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.storage = Storage.local(settings.data_dir)
        self.db = Database(settings.resolved_database_url)
        self.live = LiveRuns(self.db)  # live models: only in the leading process (coordinator/leader.py)
        self.traffic = Traffic(self.db)  # bytes moved, written by traffic.flush() (coordinator/traffic.py)
        limiter = RateLimiter({"lease": (settings.lease_rate, settings.lease_burst),
                               "upload": (settings.upload_rate, settings.upload_burst),
                               "exchange": (settings.exchange_rate, settings.exchange_burst),
                               "register": (settings.register_rate, settings.register_burst)})
        # decoding an upload's or an exchange's body holds one of these (coordinator/limits.py)
        validations = limits.Slots(settings.max_validations, wait_s=settings.validation_wait_s,
                                   what="checking other uploads")
        self.recovery = RecoveryService(self.db, self.storage, settings, live=self.live)
        self.runs = RunService(self.db, self.storage, settings, live=self.live, recovery=self.recovery)
        self.workers = WorkerService(self.db, limiter=limiter, traffic=self.traffic)
        self.leases = LeaseService(self.db, settings, limiter=limiter, workers=self.workers)
        self.downloads = DownloadService(self.db, self.storage, traffic=self.traffic, live=self.live,
                                         copies_keep=settings.update_copies_keep)
        self.spotchecks = SpotCheckService(self.db, self.storage, rate=settings.spot_check_rate, live=self.live,
                                           workers=self.workers,
                                           state_wait_s=settings.spot_check_state_wait_s)
        self.uploads = UploadService(
            self.db, self.storage, limiter=limiter, workers=self.workers, live=self.live, validations=validations,
            in_flight=limits.InFlight(settings.max_concurrent_uploads, what="delta uploads"), spotchecks=self.spotchecks,
            ungrouped=settings.ungrouped_networks)
        self.exchanges = ExchangeService(
            self.db, limiter=limiter, workers=self.workers, live=self.live, recovery=self.recovery,
            traffic=self.traffic, validations=validations,
            in_flight=limits.InFlight(settings.max_concurrent_exchanges, what="exchanges"),
            spotchecks=self.spotchecks)
        self.reports = ReportService(self.db, traffic=self.traffic, recovery=self.recovery)
        self.stats = StatsService(self.db)
        self.teams = TeamService(self.db)
        self.lifecycle = LifecycleService(self.db, self.storage, live=self.live, recovery=self.recovery,
                                          reports=self.reports)

    def close(self) -> None:
        try:
            self.traffic.flush()
        except Exception:  # the database is gone: these counts are statistics, not acknowledged work
            log.exception("could not write the last traffic counts")
        self.db.dispose()
