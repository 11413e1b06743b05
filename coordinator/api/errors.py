"""The one place where errors become HTTP answers: {"detail": "<what was wrong>"} (a 426 adds the
worker API range the coordinator serves and what to install: coordinator/api/deps.py)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError

from coordinator.errors import DiskFull, ServiceError, is_disk_full
from shared.errors import ConfigError, DeltaFormatError, SnapshotError

log = logging.getLogger(__name__)


def validation_detail(errors: list[dict], *, limit: int = 10) -> str:
    """What a request's validation errors say, without the input: FastAPI's own 422 echoes every
    offending value back ("input"), so a 150 MiB field came back whole. Each error is its location
    and pydantic's message; a location's last part is the sender's own key for an unknown field
    (said as such) and any part is cut to 64 characters."""
    parts = []
    for e in errors[:limit]:
        where = [str(part)[:64] for part in e.get("loc", ())]
        if e.get("type") == "extra_forbidden" and where:
            where[-1] = "(a field it does not take)"
        loc = ".".join(where)
        parts.append(f"{loc}: {str(e.get('msg', 'invalid'))[:300]}")
    more = f"; and {len(errors) - limit} more" if len(errors) > limit else ""
    return "; ".join(parts) + more


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": validation_detail(list(exc.errors()))}, status_code=422)

    @app.exception_handler(ServiceError)
    async def _service(_: Request, exc: ServiceError) -> JSONResponse:
        body = {**getattr(exc, "extra", {}), "detail": exc.detail}  # extra: e.g. a 426's accepted API range
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    # A full disk (a staged delta, a snapshot, a shard, a database commit) is the operator's to fix, not
    # the worker's: 503 + Retry-After, which workers wait out. Whatever failed was not acknowledged (an
    # answer says 202 only after its bytes are fsynced and its row committed). Other errors stay 500s.
    @app.exception_handler(OSError)
    @app.exception_handler(DBAPIError)
    async def _disk_full(request: Request, exc: Exception) -> JSONResponse:
        if not is_disk_full(exc):
            raise exc
        log.error("%s %s: the disk is full (%s); answering 503 until space is freed", request.method,
                  request.url.path, exc)
        full = DiskFull()
        return JSONResponse({"detail": full.detail}, status_code=full.status_code, headers=full.headers)

    @app.exception_handler(DeltaFormatError)
    @app.exception_handler(SnapshotError)
    @app.exception_handler(ConfigError)
    async def _unprocessable(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)
