"""The one place where errors become HTTP answers: {"detail": "<what was wrong>"}."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from coordinator.errors import ServiceError
from shared.errors import ConfigError, DeltaFormatError, SnapshotError


def install(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service(_: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(DeltaFormatError)
    @app.exception_handler(SnapshotError)
    @app.exception_handler(ConfigError)
    async def _unprocessable(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)
