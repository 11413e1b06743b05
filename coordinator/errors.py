"""Errors the service layer raises; api/errors.py turns each into one HTTP answer."""

from __future__ import annotations

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


class PayloadTooLarge(ServiceError):
    status_code = 413


class Unprocessable(ServiceError):
    status_code = 422


class TooManyRequests(ServiceError):
    status_code = 429

    def __init__(self, detail: str, *, retry_after: float) -> None:
        super().__init__(detail, headers={"Retry-After": str(max(1, int(retry_after + 0.999)))})


class Unavailable(ServiceError):
    """503: retry soon (e.g. the merger is changing hands between coordinator processes)."""

    status_code = 503

    def __init__(self, detail: str, *, retry_after: float = 1.0) -> None:
        super().__init__(detail, headers={"Retry-After": str(max(1, int(retry_after + 0.999)))})


class RunUnrecoverable(IdletrainError):
    """A run whose live model cannot be rebuilt from what is on disk (the coordinator will not start
    with a model it would have to guess); the message says what the operator can do."""
