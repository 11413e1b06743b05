"""Dependencies shared by the routes, as Annotated aliases so routes read as types."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from coordinator.errors import Forbidden, Unauthorized
from coordinator.models import Worker
from coordinator.service import Coordinator

_bearer = HTTPBearer(auto_error=False, description="a worker token, or the operator's admin token")


def get_coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


CoordinatorDep = Annotated[Coordinator, Depends(get_coordinator)]
# An id or index in the path. The database keeps them in 32-bit INTEGER columns, so a larger number
# is refused here (422) before a query meets it (SQLite fails past 2**63, PostgreSQL past 2**31: a 500).
RowId = Annotated[int, Path(ge=0, le=2**31 - 1)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


async def current_worker(coord: CoordinatorDep, creds: Credentials) -> Worker:
    return await run_in_threadpool(coord.authenticate, creds.credentials if creds else None)


CurrentWorker = Annotated[Worker, Depends(current_worker)]


def require_admin(coord: CoordinatorDep, creds: Credentials) -> None:
    """Operator actions: open when the coordinator has no admin token (loopback only), else guarded."""
    expected = coord.settings.admin_token
    if expected is None:
        return
    if creds is None:
        raise Unauthorized("this operator action needs the admin token (--admin-token)",
                           headers={"WWW-Authenticate": "Bearer"})
    if not secrets.compare_digest(creds.credentials, expected):
        raise Forbidden("wrong admin token")


AdminDep = Annotated[None, Depends(require_admin)]
