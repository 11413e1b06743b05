"""Dependencies shared by the routes, as Annotated aliases so routes read as types."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from coordinator.errors import Forbidden, ServiceError, Unauthorized, UpgradeRequired, worker_install
from coordinator.services.common import Caller
from coordinator.services.coordinator import Coordinator
from shared import protocol

_bearer = HTTPBearer(auto_error=False, description="a worker token, or the operator's admin token")


def get_coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


CoordinatorDep = Annotated[Coordinator, Depends(get_coordinator)]
# An id or index in the path. The database keeps them in 32-bit INTEGER columns, so a larger number
# is refused here (422) before a query meets it (SQLite fails past 2**63, PostgreSQL past 2**31: a 500).
RowId = Annotated[int, Path(ge=0, le=2**31 - 1)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


async def current_worker(coord: CoordinatorDep, creds: Credentials) -> Caller:
    return await run_in_threadpool(coord.workers.authenticate, creds.credentials if creds else None)


CurrentWorker = Annotated[Caller, Depends(current_worker)]


def require_admin(request: Request, creds: Credentials) -> None:
    """Operator actions: always the admin token, and only as `Authorization: Bearer` (never a cookie
    or a query parameter). A browser cannot add that header to a cross-origin request without a
    CORS preflight, which this server never grants, so a page the operator visits cannot act (CSRF)."""
    expected: str = request.app.state.admin_token
    if creds is None:
        raise Unauthorized("this operator action needs the admin token: pass --admin-token, set "
                           "IDLETRAIN_ADMIN_TOKEN, or run the command where it can read the coordinator's "
                           "data_dir/admin_token (--data-dir)", headers={"WWW-Authenticate": "Bearer"})
    if not secrets.compare_digest(creds.credentials.encode(), expected.encode()):
        raise Forbidden("wrong admin token")


AdminDep = Annotated[None, Depends(require_admin)]


def served_api(request: Request) -> None:
    """Every request but /healthz (which says the range): a worker's X-Idletrain-Api must lie in
    MIN_API_VERSION..API_VERSION, else 426 with the range and what to install. Requests without the
    header (curl, the operator's commands) are taken as of the current version."""
    sent = request.headers.get(protocol.H_API_VERSION)
    if sent is None or request.url.path == "/healthz":
        return
    if not (sent.isascii() and sent.isdecimal() and len(sent) <= 6):
        raise ServiceError(f"{protocol.H_API_VERSION} must be a worker API version number, not {sent[:20]!r}")
    low, high = protocol.MIN_API_VERSION, protocol.API_VERSION
    if low <= int(sent) <= high:
        return
    install = worker_install()
    served = f"v{low}" if low == high else f"v{low}..v{high}"
    raise UpgradeRequired(f"this coordinator serves worker API {served}, not v{int(sent)}: {install}",
                          extra={"min_api_version": low, "api_version": high, "worker_install": install})


def worker_api(request: Request) -> int:
    """The worker API version a request says it speaks (served_api checked it); the current one
    when it says none."""
    sent = request.headers.get(protocol.H_API_VERSION)
    return int(sent) if sent is not None and sent.isascii() and sent.isdecimal() else protocol.API_VERSION
