"""Errors the service layer raises; api/errors.py turns each into one HTTP answer."""

from __future__ import annotations

import errno
import importlib.metadata

from shared.errors import IdletrainError


class ServiceError(IdletrainError):
    status_code = 400

    def __init__(self, detail: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers or {}


class Unauthorized(ServiceError):
    status_code = 401


class Forbidden(ServiceError):
    status_code = 403


class NotFound(ServiceError):
    status_code = 404


class Conflict(ServiceError):
    status_code = 409


class Gone(ServiceError):
    status_code = 410


class RequestTimeout(ServiceError):
    """408: the request's body stopped arriving (settings.body_timeout_s without a byte)."""

    status_code = 408


class PayloadTooLarge(ServiceError):
    status_code = 413


class Unprocessable(ServiceError):
    status_code = 422


def worker_install() -> str:
    """What a worker outside the served API range installs: this coordinator's own release."""
    try:
        return f"pip install -U 'idletrain=={importlib.metadata.version('idletrain')}'"
    except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
        return "pip install -U idletrain"


class UpgradeRequired(ServiceError):
    """426: a worker of an API version this coordinator does not serve. `extra` joins the answer's
    body: the range it serves and what to install."""

    status_code = 426

    def __init__(self, detail: str, *, extra: dict[str, object]) -> None:
        super().__init__(detail)
        self.extra = extra


class TooManyRequests(ServiceError):
    status_code = 429

    def __init__(self, detail: str, *, retry_after: float) -> None:
        super().__init__(detail, headers={"Retry-After": str(max(1, int(retry_after + 0.999)))})


class Unavailable(ServiceError):
    """503: retry soon (e.g. the merger is changing hands between coordinator processes)."""

    status_code = 503

    def __init__(self, detail: str, *, retry_after: float = 1.0) -> None:
        super().__init__(detail, headers={"Retry-After": str(max(1, int(retry_after + 0.999)))})


DISK_FULL_RETRY_S = 30.0  # what a disk-full 503 asks workers to wait: space comes back by hand, not in a second
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_SQLITE_FULL = 13  # SQLITE_FULL: "database or disk is full"
_PG_DISK_FULL = "53100"  # PostgreSQL's SQLSTATE disk_full


class DiskFull(Unavailable):
    """503: a write failed for want of space (ENOSPC, EDQUOT, or the database's own "disk full"); nothing
    was acknowledged, and the same request succeeds once the operator frees space."""

    def __init__(self, detail: str = "the coordinator's disk is full; retry later", *,
                 retry_after: float = DISK_FULL_RETRY_S) -> None:
        super().__init__(detail, retry_after=retry_after)


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether `exc`, or an error it wraps (SQLAlchemy's `.orig`, a `raise ... from`), says the disk
    or the quota is full: an OSError with ENOSPC or EDQUOT, SQLite's SQLITE_FULL, PostgreSQL's 53100."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError):
            if exc.errno in _DISK_FULL_ERRNOS:
                return True
        elif getattr(exc, "sqlstate", None) == _PG_DISK_FULL:
            return True
        elif type(exc).__module__ == "sqlite3" and (
                getattr(exc, "sqlite_errorcode", None) == _SQLITE_FULL or "database or disk is full" in str(exc)):
            # SQLite's own words, not SQLAlchemy's wrapper (whose text holds the statement's parameters,
            # which a client chose); the error code is there only when the sqlite3 module sets it
            return True
        exc = getattr(exc, "orig", None) or exc.__cause__ or exc.__context__
    return False


class RunUnrecoverable(IdletrainError):
    """A run whose live model cannot be rebuilt from what is on disk (the coordinator will not start
    with a model it would have to guess); the message says what the operator can do."""
