"""create_app(settings): the FastAPI application, its lifespan, the merger thread and the election.

Every coordinator process serves the whole API. The one holding the merger lock (coordinator/leader.py)
also holds the live models, runs the merger and answers exchanges; the others relay those to it
(coordinator/api/relay.py) and take the lock over when its holder dies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading

import torch
from fastapi import Depends, FastAPI

from coordinator import admin, hosts, leader, limits, timing
from coordinator.api import (dashboard, deps, downloads, errors, exchanges, leases, metrics, relay, reports, runs,
                             stats, teams, uploads, workers)
from coordinator.db import driver_url
from coordinator.merger import Merger
from coordinator.services.coordinator import Coordinator
from coordinator.settings import CoordinatorSettings
from shared import protocol
from shared.extras import MissingExtra

log = logging.getLogger(__name__)

# the routes whose bodies are deltas (coordinator/api/uploads.py, exchanges.py): read under max_upload_bytes
UPLOAD_PATHS = re.compile(rf"^{re.escape(protocol.API_PREFIX)}/leases/\d+/(delta|exchange|start-state)$")


class Election:
    """Takes the merger lock when it is free, loads the live models, starts the merger; steps down
    when the lock's connection is lost. While leading it also loads runs other processes created."""

    def __init__(self, app: FastAPI, coord: Coordinator, merger: Merger, *, start_merger: bool) -> None:
        self.app, self.coord, self.merger, self.start_merger = app, coord, merger, start_merger
        self.leadership = leader.Leadership(coord.db.engine)
        coord.live.leadership = self.leadership
        self.listener: relay.LeaderListener | None = None
        self._published = False  # whether leader.json says where self.listener is
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="idletrain-election", daemon=True)

    def start(self) -> None:
        """Ask once now (so a lone process leads from its first request on), then keep asking."""
        if self.leadership.try_take():
            self._lead()
        else:
            self.coord.live.leads = False
            log.info("process %d serves without the live models; another coordinator process merges", os.getpid())
        self._thread.start()

    def _lead(self) -> None:
        coord, settings = self.coord, self.coord.settings
        coord.live.drop()
        coord.recovery.load_runs()  # the newest checkpoint + a replay of what the database holds since
        coord.live.leads = True
        if settings.relay:
            self.listener = relay.LeaderListener(self.app)
            self.listener.start()
            self._publish()
        if self.start_merger:
            self.merger.start()
        log.info("process %d holds the merger lock: it merges%s", os.getpid(),
                 f" and takes relayed requests on {self.listener.url}" if self.listener else "")

    def _publish(self) -> None:
        """Write leader.json. Not fatal on a full disk: the other processes answer what needs the live
        model with 503 meanwhile, and the election loop tries again every leader_poll_s."""
        try:
            leader.publish(self.coord.settings.data_dir, self.listener.url)
            self._published = True
        except OSError as exc:
            log.error("cannot write %s (%s); other coordinator processes cannot relay here until it is written",
                      leader.LEADER_FILE, exc)

    def _step_down(self) -> None:
        self.coord.live.leads = False
        self.merger.stop(checkpoint=False)
        self.coord.live.drop()
        self._close_listener()
        log.error("process %d lost the merger lock; another process will merge", os.getpid())

    def _close_listener(self) -> None:
        if self.listener is not None:
            leader.unpublish(self.coord.settings.data_dir)
            self.listener.stop()
            self.listener = None
            self._published = False

    def _loop(self) -> None:
        poll_s = self.coord.settings.leader_poll_s
        while not self._stop.wait(poll_s):
            try:
                self.coord.traffic.flush()  # every process: the bytes it served (coordinator/traffic.py)
                if self.leadership.held:
                    if not self.leadership.still_held():
                        self._step_down()
                    else:
                        self.coord.recovery.sync_runs()
                        if self.listener is not None and not self._published:
                            self._publish()
                elif self.leadership.try_take():
                    self._lead()
            except Exception:  # the database is away: keep trying
                log.exception("election error")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.merger.stop()
        self._close_listener()
        self.leadership.release()


def create_app(settings: CoordinatorSettings, *, start_merger: bool = True) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        torch.set_num_threads(settings.eval_threads)
        # before anything else: a token file open to others stops the start (coordinator/admin.py)
        app.state.admin_token, _ = admin.ensure_token(settings.data_dir, settings.admin_token)
        coord = Coordinator(settings)
        app.state.metrics = metrics.AppMetrics(coord)
        merger = Merger(coord, on_merged=app.state.metrics.observe_merge)
        app.state.coordinator, app.state.merger = coord, merger
        election = Election(app, coord, merger, start_merger=start_merger)
        election.start()
        coord.live.warm_up()
        try:
            yield
        finally:
            election.stop()
            client = getattr(app.state, "relay_client", None)
            if client is not None:
                await client.aclose()
            coord.close()

    # every route refuses workers of an API version it no longer serves (426; /healthz says the range)
    app = FastAPI(title="idletrain coordinator", version=str(protocol.API_VERSION), lifespan=lifespan,
                  dependencies=[Depends(deps.served_api)])
    errors.install(app)
    app.add_middleware(timing.ServerTiming)  # each answer says where its time went (coordinator/timing.py)
    # every JSON body capped at max_json_bytes before it is read; uploads stream under their own cap
    app.add_middleware(limits.BodyCap, cap=settings.max_json_bytes, exempt=UPLOAD_PATHS)
    # outermost: a request for a name this coordinator is not known by does nothing (DNS rebinding)
    app.add_middleware(hosts.HostGuard, allowed=hosts.allowed_hosts(settings))

    install = deps.worker_install()

    @app.get("/healthz", response_model=protocol.Health, tags=["health"])
    async def healthz() -> protocol.Health:
        return protocol.Health(keeps_delivering_lease=True, api_version=protocol.API_VERSION,
                               min_api_version=protocol.MIN_API_VERSION,
                               worker_install=install, max_upload_bytes=settings.max_upload_bytes)

    app.include_router(runs.router)
    app.include_router(reports.router)
    app.include_router(workers.router)
    app.include_router(teams.router)
    app.include_router(leases.router)
    app.include_router(uploads.router)
    app.include_router(exchanges.router)
    app.include_router(downloads.router)
    app.include_router(dashboard.router)
    app.include_router(metrics.router)
    app.include_router(stats.router)
    return app


def app_from_environment() -> FastAPI:
    """The factory `serve --processes N` hands uvicorn: each process reads the settings from the
    IDLETRAIN_* environment the parent set. A database driver that is not installed ends the
    process with one line saying what to install (serve checks it before starting any process)."""
    settings = CoordinatorSettings()
    try:
        driver_url(settings.resolved_database_url)
    except (MissingExtra, ValueError) as exc:
        raise SystemExit(f"idletrain: {exc}") from None
    return create_app(settings)

