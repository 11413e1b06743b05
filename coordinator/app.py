"""create_app(settings): the FastAPI application, its lifespan, and the merger thread."""

from __future__ import annotations

import contextlib
import logging

import torch
from fastapi import FastAPI

from coordinator.api import blobs, dashboard, errors, metrics, runs, workers
from coordinator.merger import Merger
from coordinator.service import Coordinator
from coordinator.settings import CoordinatorSettings
from shared import protocol

log = logging.getLogger(__name__)


def create_app(settings: CoordinatorSettings, *, start_merger: bool = True) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        torch.set_num_threads(settings.eval_threads)
        coord = Coordinator(settings)
        coord.load_runs()
        app.state.metrics = metrics.AppMetrics(coord)
        merger = Merger(coord, on_merged=app.state.metrics.observe_merge)
        app.state.coordinator, app.state.merger = coord, merger
        if start_merger:
            merger.start()
        try:
            yield
        finally:
            merger.stop()
            coord.close()

    app = FastAPI(title="idletrain coordinator", version=str(protocol.API_VERSION), lifespan=lifespan)
    errors.install(app)

    @app.get("/healthz", response_model=protocol.Health, tags=["health"])
    async def healthz() -> protocol.Health:
        return protocol.Health()

    app.include_router(runs.router)
    app.include_router(workers.router)
    app.include_router(blobs.router)
    app.include_router(dashboard.router)
    app.include_router(metrics.router)
    return app
