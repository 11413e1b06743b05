"""The coordinator's error answers, as the worker acts on them. worker/client.py raises them (and
re-exports them); the loop, the delivery and the connection act on their kind:

    transient     no connection, a timeout, 408, 429, 5xx: waited for and asked again (is_transient)
    this delta    a delta refused for good (DELTA_REFUSED: its lease gone, given up or too stale, its
                  bytes refused): its content goes back to the residual and the worker goes on
    blocked       asking again cannot help until someone acts (Blocked): the worker says once what
                  is wrong and what to do, keeps everything it trained (an undelivered delta stays on
                  disk), and waits, asking the coordinator again every few minutes; it never exits

    CoordinatorError(status, detail, retry_after)   any error answer
     └── Blocked                                    message(): what is wrong and what to do
          ├── UploadTooLarge   413: a body over the coordinator's cap (limit_bytes, size_bytes)
          ├── VersionRefused   426, or a /healthz whose API range leaves this worker out
          ├── NotAdmitted      401, 403: the token unknown, revoked or banned, the join key wrong;
          │                    400, 409, 422 to a registration (its name or key refused)
          ├── RunUnavailable   404, 410 to a lease request or a registration: no such run, or finished
          └── NotACoordinator  /healthz answered, but not as a coordinator does: --coordinator is wrong
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx

from shared import protocol

LEASE_LOST = (404, 409, 410)  # the lease is gone, delivered otherwise, or too stale: take a new one
# A delta refused for good: the lease lost, or its bytes refused (400, 422). Its content goes back to the residual.
DELTA_REFUSED = (400, *LEASE_LOST, 422)
# A delta saved before a restart is also dropped when its lease is another worker's (a new token since).
REDELIVERY_REFUSED = (*DELTA_REFUSED, 403)


def size_text(n: int) -> str:
    """A byte count as a person reads it: 71.0 MiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


class CoordinatorError(Exception):
    """The coordinator answered with an error; `detail` says why, `retry_after` (seconds) when it
    said how long to wait (429, 503)."""

    def __init__(self, status: int, detail: str, retry_after: float | None = None) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail
        self.retry_after = retry_after


class Blocked(CoordinatorError):
    """An answer that asking again will not change until someone acts (the operator, the volunteer).
    `recheck_s`: how long the worker waits before it asks the coordinator again."""

    recheck_s = 600.0

    def message(self) -> str:
        """One line: what is wrong and what to do."""
        return f"the coordinator refuses this worker (HTTP {self.status}: {self.detail})"


class UploadTooLarge(Blocked):
    """413: the body is over the coordinator's upload cap. `limit_bytes` from its answer (None when
    it did not say), `size_bytes` set by the upload that was refused."""

    def __init__(self, status: int, detail: str, *, limit_bytes: int | None, size_bytes: int | None = None,
                 what: str = "this round's delta") -> None:
        super().__init__(status, detail)
        self.limit_bytes, self.size_bytes, self.what = limit_bytes, size_bytes, what

    def message(self) -> str:
        over = f"over {size_text(self.limit_bytes)}" if self.limit_bytes is not None else "this large"
        if self.limit_bytes is not None and self.size_bytes is not None and self.size_bytes <= self.limit_bytes:
            over = (f"this large, though it says it takes up to {size_text(self.limit_bytes)} (a proxy in front of "
                    "it may cap uploads lower)")
        size = f" is {size_text(self.size_bytes)}" if self.size_bytes is not None else ""
        return (f"the coordinator refuses uploads {over}; {self.what}{size}: ask the operator to raise its upload "
                "cap (IDLETRAIN_MAX_UPLOAD_BYTES) or to run a smaller model or a stronger compression. The delta "
                "is kept and delivered once the coordinator takes it; nothing is trained meanwhile")

    def fits(self, limit_bytes: int | None) -> bool:
        """Whether a coordinator whose cap is now `limit_bytes` (None: not said) may take it."""
        if limit_bytes is None:
            return True  # an older coordinator does not say: only an upload tells
        if self.size_bytes is not None:
            return self.size_bytes <= limit_bytes
        return self.limit_bytes is None or limit_bytes > self.limit_bytes


class VersionRefused(Blocked):
    """The coordinator serves workers of API versions min_version..max_version, not this one's."""

    recheck_s = 300.0

    def __init__(self, status: int, detail: str, *, mine: int, min_version: int | None, max_version: int | None,
                 install: str | None, oldest: int | None = None) -> None:
        """`mine`: the version the worker speaks, or the newest of those it speaks from `oldest` up."""
        super().__init__(status, detail)
        self.mine, self.min_version, self.max_version, self.install = mine, min_version, max_version, install
        self.oldest = mine if oldest is None else oldest

    def message(self) -> str:
        if self.min_version is None or self.max_version is None:
            accepts = f"refuses worker API v{self.mine} ({self.detail})"
        else:
            accepts = (f"accepts worker API v{self.min_version}" + (f"..v{self.max_version}"
                       if self.max_version != self.min_version else "") + ", this worker speaks "
                       + (f"v{self.mine}" if self.oldest == self.mine else f"v{self.oldest}..v{self.mine}"))
        install = self.install or "pip install -U idletrain"
        newer = " (this worker is newer: the operator may also upgrade the coordinator)" if (
            self.max_version is not None and self.mine > self.max_version) else ""
        return (f"the coordinator {accepts}: install a worker it accepts ({install}; in a checkout: update it and "
                f"pip install -e .) and start it again{newer}. Waiting, asking again every few minutes")


def served_range(health: protocol.Health) -> tuple[int, int]:
    """The worker API versions a coordinator with this /healthz serves. One that does not say its
    oldest (older coordinators) serves only its own."""
    low = getattr(health, "min_api_version", None)  # (getattr: a stand-in for the answer may lack the newer fields)
    return (health.api_version if low is None else low), health.api_version


def spoken_version(health: protocol.Health, mine: int, *, oldest: int | None = None) -> int | None:
    """The API version a worker speaking `oldest`..`mine` (oldest None: only `mine`) speaks to a
    coordinator with this /healthz: the highest both know; None when they share none."""
    low, high = served_range(health)
    version = min(mine, high)
    return version if version >= max(low, mine if oldest is None else oldest) else None


def version_refusal(health: protocol.Health, mine: int, *, oldest: int | None = None) -> VersionRefused | None:
    """Why a coordinator with this /healthz serves none of the API versions `oldest`..`mine` of a
    worker (oldest None: only `mine`), or None."""
    if spoken_version(health, mine, oldest=oldest) is not None:
        return None
    low, high = served_range(health)
    return VersionRefused(426, "by its /healthz", mine=mine, min_version=low, max_version=high,
                          install=getattr(health, "worker_install", None), oldest=oldest)

class NotAdmitted(Blocked):
    """401, 403: the coordinator does not know the token, revoked it or banned its worker, or the
    join key is wrong; 400, 409, 422 to a registration: its name, team or contributor key refused."""

    def message(self) -> str:
        if self.status == 401:
            todo = "check --token and --join-key"
        elif self.status == 403:
            todo = ("check --join-key, --contributor-key and --team-key, or ask the operator (a revoked or banned "
                    "token stays refused)")
        else:
            todo = "change --name, --team, --contributor-key or --team-key and start the worker again"
        return f"the coordinator does not admit this worker ({self.detail}): {todo}. Waiting, asking again in a while"


class NotACoordinator(Blocked):
    """/healthz answered, but not as an idletrain coordinator does (a 404, a page of HTML)."""

    def __init__(self, url: str, answer: str) -> None:
        super().__init__(0, answer)
        self.url = url

    def message(self) -> str:
        return (f"{self.url} does not answer /healthz as an idletrain coordinator ({self.detail[:300]}): check "
                "--coordinator (the address, http or https, a proxy's path). Waiting, asking again in a while")


class RunUnavailable(Blocked):
    """404, 410 to a lease request or a registration: the run does not exist here, or is over. A
    whole-coordinator worker may move on to another run; a worker of one run waits."""

    def __init__(self, status: int, detail: str, *, run: str) -> None:
        super().__init__(status, detail)
        self.run = run

    def message(self) -> str:
        if self.status == 410:  # the worker stops (loop.py): a finished run never hands out work again
            said = self.detail if self.detail.startswith(f"run {self.run!r}") else f"run {self.run!r} finished ({self.detail})"
            return (f"{said}: nothing more to train, so this worker stops. Pick another run (--run), or leave "
                    "--run out to follow whatever the coordinator trains")
        return (f"run {self.run!r} is not available ({self.detail}): pick another run (--run), or wait for the "
                "operator to resume it. Waiting, asking again in a while")


def error_for(status: int, detail: str, *, retry_after: float | None, headers: Mapping[str, str],
              body: Mapping | None, api_version: int) -> CoordinatorError:
    """The exception for an error answer (a Blocked one for 401, 403, 413, 426)."""
    if status == 413:
        return UploadTooLarge(status, detail, limit_bytes=byte_count(headers.get(protocol.H_MAX_BODY))
                              or byte_count(_limit_in(detail)))
    if status == 426:
        def number(key: str) -> int | None:
            value = (body or {}).get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else None
        install = (body or {}).get("worker_install")
        return VersionRefused(status, detail, mine=api_version, min_version=number("min_api_version"),
                              max_version=number("api_version"), install=install if isinstance(install, str) else None)
    if status in (401, 403):
        return NotAdmitted(status, detail)
    return CoordinatorError(status, detail, retry_after=retry_after)


def byte_count(text: str | None) -> int | None:
    """A cap the coordinator states: 1 to 2^63 - 1 bytes in ASCII digits; None for anything else (0,
    -1, 10^30, 1e9, a number of 5,000 digits, which int() refuses to read)."""
    if not text or not (text.isascii() and text.isdecimal()) or len(text) > 19:
        return None
    value = int(text)
    return value if 0 < value <= protocol.MAX_ID else None


def _limit_in(detail: str) -> str | None:
    """The cap an older coordinator's 413 names in its words ("exceeds the limit of N bytes")."""
    m = re.search(r"limit of (\d{1,19}) bytes", detail)
    return m.group(1) if m else None


def is_transient(exc: BaseException) -> bool:
    """Whether waiting and asking again may help: no connection, a timeout, 408, 429, 5xx."""
    if isinstance(exc, httpx.TransportError):
        return True
    if isinstance(exc, CoordinatorError) and not isinstance(exc, Blocked):
        return exc.status in (0, 408, 429) or exc.status >= 500
    return False


def why(exc: BaseException) -> str:
    """A failure as a log line says it: the coordinator's status and detail, else the exception."""
    if isinstance(exc, CoordinatorError):
        return f"HTTP {exc.status}: {exc.detail}"
    return repr(exc)


MAX_RETRY_AFTER_S = 600.0  # a Retry-After longer than this is taken as this


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header (seconds or an HTTP date) in seconds, within 0..MAX_RETRY_AFTER_S."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    if math.isnan(seconds):
        return None
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds))
