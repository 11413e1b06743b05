"""The HTTP client: the only module of the worker that touches the network (httpx).

Every answer from the coordinator is checked: hashes of snapshots and shards, sizes, and
the snapshot's contents (safetensors, never pickle). Network errors, 5xx and 429 answers are
retried with exponential backoff and jitter (up to max_retries per request); a 429 or 503 that
says Retry-After is waited out as it asks. Other 4xx answers are never retried; worker/answers.py
says what each means to the worker (those no retry can mend raise a Blocked error).

Every request says the worker's API version (X-Idletrain-Api); a coordinator that no longer serves
it answers 426 (VersionRefused).

Every answer is read in chunks and decoded here (worker/reading.py), capped while it streams at
max_download_bytes (the machine's cap) and, for a download, at what the lease says it can weigh
(worker/sizes.py); with set_transfer(...) request bodies and answers are paced by token buckets
(--max-upload-kbps, --max-download-kbps, worker/throttle.py) and every byte is reported to a meter
(the daily cap).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import httpx
import zstandard
from pydantic import BaseModel, ValidationError

from shared import protocol
from worker.answers import (DELTA_REFUSED, LEASE_LOST, MAX_RETRY_AFTER_S, REDELIVERY_REFUSED, Blocked,
                            CoordinatorError, NotAdmitted, RunUnavailable, UploadTooLarge, VersionRefused, error_for,
                            is_transient, retry_after_s, spoken_version, version_refusal, why)
from worker.reading import ACCEPT_ENCODING, IntegrityError, read_body
from worker.throttle import TokenBucket, paced

log = logging.getLogger(__name__)

MACHINE_CAP_TEXT = "this worker's download cap allows (--max-params, --max-memory)"  # what an answer over it says


def backoff_delay(attempt: int) -> float:
    """Exponential backoff with jitter: 0.5 s doubling per attempt, capped at 60 s, spread 0.5x..1.5x."""
    return min(60.0, 0.5 * 2 ** attempt) * (0.5 + random.random())


# The error answers and their kinds live in worker/answers.py; importers keep taking them from here.
__all__ = ["Blocked", "CoordinatorClient", "CoordinatorError", "DELTA_REFUSED", "IntegrityError", "InvalidAnswer",
           "LEASE_LOST", "NotAdmitted", "REDELIVERY_REFUSED", "RunUnavailable", "UploadTooLarge", "VersionRefused",
           "backoff_delay", "is_transient", "retry_after_s", "why"]


@contextlib.contextmanager
def _run_refusal(run: str) -> Iterator[None]:
    """A 404 or 410 to a request about the run itself: the run is not there (RunUnavailable)."""
    try:
        yield
    except CoordinatorError as exc:
        if exc.status in (404, 410) and not isinstance(exc, Blocked):
            raise RunUnavailable(exc.status, exc.detail, run=run) from None
        raise


_M = TypeVar("_M", bound=BaseModel)


class InvalidAnswer(Exception):
    """An answer that is not what the protocol says it is (a lease whose shard hash is a path, an
    id out of range, a model config that does not validate): refused, never acted on."""


def invalid_answer(what: str, exc: ValueError) -> InvalidAnswer:
    """An InvalidAnswer saying which fields of `what` broke which rule (at most 5 of them)."""
    if isinstance(exc, ValidationError):
        why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5])
    else:
        why = f"not JSON ({exc})"
    return InvalidAnswer(f"the coordinator's {what} is not valid ({why})")


def _parse(model: type[_M], resp: httpx.Response, what: str) -> _M:
    try:
        return model.model_validate(resp.json())
    except ValueError as exc:  # not JSON, or not the protocol's form (ValidationError is a ValueError)
        raise invalid_answer(what, exc) from None


class CoordinatorClient:
    EXCHANGE_RETRIES = 2  # at most, for exchanges: late answers are worth little, and training goes on without them

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 60.0, max_retries: int = 8,
                 transport: httpx.BaseTransport | None = None, max_download_bytes: int = 1 << 31,
                 api_version: int = protocol.API_VERSION, min_api_version: int = protocol.MIN_API_VERSION) -> None:
        """`api_version`..`min_api_version`: the worker API versions this client speaks (this
        release's: protocol.API_VERSION down to MIN_API_VERSION); it says the highest until `speak`
        picks the one a coordinator serves."""
        self.token = token
        self.newest_api_version, self.oldest_api_version = api_version, min(min_api_version, api_version)
        self.max_upload_bytes: int | None = None  # the coordinator's upload cap, as its last /healthz said
        self.max_retries = max_retries
        self.max_download_bytes = max_download_bytes
        self.bytes_up = 0  # delta and exchange bodies delivered
        self.bytes_down = 0  # snapshots, shards and exchange answers received
        self.sent_bytes = 0  # every request body, retries included (what crossed the wire)
        self.received_bytes = 0  # every answer body, retries included
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s, transport=transport,
                                  headers={"Accept-Encoding": ACCEPT_ENCODING})
        self.speak(api_version)
        self.upload_bucket: TokenBucket | None = None
        self.download_bucket: TokenBucket | None = None
        self.meter: Callable[[int], None] | None = None

    def speak(self, version: int) -> None:
        """Say API `version` in every request from now on (X-Idletrain-Api, User-Agent)."""
        self.api_version = version
        self._http.headers.update({"User-Agent": f"idletrain-worker/api{version}",
                                   protocol.H_API_VERSION: str(version)})

    def agree_version(self, health: protocol.Health) -> VersionRefused | None:
        """Speak the highest API version both this client and the coordinator of this /healthz know:
        a newer worker speaks an older coordinator's version (the newer ones only add what a run asks
        for, and a run that needs it answers a lease request 426); why not, when they share none."""
        version = spoken_version(health, self.newest_api_version, oldest=self.oldest_api_version)
        if version is None:
            return version_refusal(health, self.newest_api_version, oldest=self.oldest_api_version)
        self.speak(version)
        return None

    def set_transfer(self, *, upload_bytes_per_s: float | None = None, download_bytes_per_s: float | None = None,
                     meter: Callable[[int], None] | None = None) -> None:
        """Pace request bodies and answers to these rates (None: as fast as the link goes) and report
        every byte sent or received to `meter` (retries included: they cross the wire too)."""
        self.upload_bucket = TokenBucket(upload_bytes_per_s) if upload_bytes_per_s else None
        self.download_bucket = TokenBucket(download_bytes_per_s) if download_bytes_per_s else None
        self.meter = meter

    def _count_up(self, n: int) -> None:
        self.sent_bytes += n
        if self.meter is not None and n > 0:
            self.meter(n)

    def _count_down(self, n: int) -> None:
        self.received_bytes += n
        if self.meter is not None and n > 0:
            self.meter(n)

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, url: str, *, max_retries: int | None = None, max_bytes: int | None = None,
                 expected: str = MACHINE_CAP_TEXT, **kw) -> httpx.Response:
        """`max_bytes`: the most the answer can weigh, `expected` saying why (within max_download_bytes)."""
        headers = kw.pop("headers", {})
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        retries = self.max_retries if max_retries is None else min(max_retries, self.max_retries)
        for attempt in range(retries + 1):
            try:
                resp = self._send(method, url, headers=headers, max_bytes=max_bytes, expected=expected, **kw)
            except httpx.TransportError as exc:
                if attempt == retries:
                    raise
                self._backoff(attempt, f"coordinator unreachable ({method} {url}: {exc!r})")
                continue
            code = resp.status_code
            wait = retry_after_s(resp.headers.get("Retry-After")) if code in (429, 503) else None
            if (code >= 500 or code == 429) and attempt < retries:
                self._backoff(attempt, f"{method} {url}: HTTP {code}", wait=wait)
                continue
            if code >= 400:
                try:
                    body = resp.json()
                except ValueError:
                    body = None
                body = body if isinstance(body, dict) else None
                detail = body.get("detail", resp.text) if body is not None else resp.text
                raise error_for(code, str(detail)[:2000], retry_after=wait, headers=resp.headers, body=body,
                                api_version=self.api_version)
            return resp
        raise AssertionError("unreachable")

    def _send(self, method: str, url: str, *, headers: dict, content: bytes | None = None, max_bytes: int | None,
              expected: str, **kw) -> httpx.Response:
        """One attempt. The body goes out paced (with an explicit Content-Length: not chunked); the
        answer comes in chunks, paced, counted, decoded and capped (at max_bytes, within
        max_download_bytes), and is returned as a plain in-memory response."""
        body = content
        if content is not None and self.upload_bucket is not None:
            headers = {**headers, "Content-Length": str(len(content))}
            body = paced(content, self.upload_bucket, count=self._count_up)
        request = self._http.build_request(method, url, headers=headers, content=body, **kw)
        if self.upload_bucket is None or content is None:
            self._count_up(len(request.content) if content is None else len(content))
        cap = self.max_download_bytes
        if max_bytes is not None and max_bytes < cap:
            cap = max_bytes
        else:
            expected = MACHINE_CAP_TEXT
        resp = self._http.send(request, stream=True)
        try:
            body = read_body(resp, cap=cap, what=f"{method} {url}", expected=expected, bucket=self.download_bucket,
                             count=self._count_down)
        finally:
            resp.close()
        # The body is decoded already: drop the headers that describe its encoding on the wire.
        headers_out = [(k, v) for k, v in resp.headers.multi_items()
                       if k.lower() not in ("content-encoding", "transfer-encoding", "content-length")]
        return httpx.Response(resp.status_code, headers=headers_out, content=body, request=request)

    @staticmethod
    def _backoff(attempt: int, why: str, *, wait: float | None = None) -> None:
        """Sleep before the next attempt: `wait` (the server's Retry-After, plus up to 10% so a crowd
        of workers does not come back at once) or exponential backoff with jitter."""
        delay = wait * (1.0 + 0.1 * random.random()) if wait is not None else backoff_delay(attempt)
        log.warning("%s; retrying in %.1fs", why, delay)
        time.sleep(delay)

    # -- API ------------------------------------------------------------------------------------

    def health(self, *, max_retries: int | None = None) -> protocol.Health:
        """/healthz; `max_retries` lowers the retries for this call (the worker waits in its own loop).
        Keeps the upload cap it says (max_upload_bytes)."""
        resp = self._request("GET", "/healthz", max_retries=max_retries)
        health = _parse(protocol.Health, resp, "/healthz")
        self.max_upload_bytes = health.max_upload_bytes
        return health

    def register(self, run: str, req: protocol.RegisterRequest) -> protocol.RegisterResponse:
        """RunUnavailable when the run does not exist (404) or is over (410); NotAdmitted when the
        registration itself is refused (its name taken, a key wrong)."""
        with _run_refusal(run):
            try:
                resp = self._request("POST", f"{protocol.API_PREFIX}/runs/{run}/workers",
                                     json=req.model_dump(exclude_none=True))  # what an older coordinator knows
            except CoordinatorError as exc:
                if exc.status in (400, 409, 422):
                    raise NotAdmitted(exc.status, exc.detail) from None
                raise
        return _parse(protocol.RegisterResponse, resp, "registration")

    def lease(self, run: str, *, keep: int | None = None) -> tuple[protocol.Lease | None, float]:
        """(lease, 0) or (None, seconds to wait) when there is no work right now. `keep`: the lease
        whose delta is still uploading (asked only of a coordinator that keeps such a lease; others
        give up every earlier lease of the worker that asks). RunUnavailable when the run does not
        exist (404) or is over (410): no lease of it will come."""
        with _run_refusal(run):
            resp = self._request("POST", f"{protocol.API_PREFIX}/runs/{run}/leases",
                                 params={"keep": keep} if keep is not None else None)
        if resp.status_code == 204:
            try:
                return None, float(resp.headers.get("Retry-After", "2"))
            except ValueError:
                return None, 2.0
        return _parse(protocol.Lease, resp, "lease"), 0.0

    def _download(self, url: str, headers: dict | None = None, *, max_bytes: int | None,
                  expected: str) -> httpx.Response:
        resp = self._request("GET", url, headers=dict(headers or {}), max_bytes=max_bytes, expected=expected)
        self.bytes_down += len(resp.content)
        return resp

    def snapshot(self, run: str, version: int | str, *, if_sha256: str | None = None,
                 max_bytes: int | None = None) -> tuple[bytes | None, int]:
        """(zstd safetensors bytes, version); the body's hash is checked against its header.
        if_sha256: the hash of a copy this worker made itself; (None, version) when the coordinator's
        snapshot has that hash (304: nothing downloaded), the snapshot as usual when it differs.
        `max_bytes`: the most a snapshot of the lease's model weighs (worker/sizes.py)."""
        headers = {"If-None-Match": f'"{if_sha256}"'} if if_sha256 else None
        resp = self._download(f"{protocol.API_PREFIX}/runs/{run}/snapshots/{version}", headers, max_bytes=max_bytes,
                              expected="a snapshot of the lease's model can weigh")
        sha = resp.headers.get(protocol.H_SHA256, "")
        if resp.status_code == 304:
            if not if_sha256 or sha != if_sha256:
                raise IntegrityError(f"snapshot {version}: 304 for a hash other than the one asked about")
            return None, self._answered_version(resp, version)
        if hashlib.sha256(resp.content).hexdigest() != sha:
            raise IntegrityError(f"snapshot {version} does not match its announced SHA-256")
        return resp.content, self._answered_version(resp, version)

    @staticmethod
    def _answered_version(resp: httpx.Response, asked: int | str) -> int:
        """The X-Model-Version of a snapshot: a decimal version, the one asked for unless 'latest'."""
        value = resp.headers.get(protocol.H_VERSION, "")
        if not (value.isascii() and value.isdecimal()) or len(value) > 19 or int(value) > protocol.MAX_ID:
            raise IntegrityError(f"snapshot {asked}: {protocol.H_VERSION} {value[:40]!r} is not a version")
        if isinstance(asked, int) and int(value) != asked:
            raise IntegrityError(f"snapshot {asked}: the coordinator answered version {value}")
        return int(value)

    def model_update(self, run: str, from_version: int, to_version: int, *, copy: str | None = None,
                     max_bytes: int | None = None) -> tuple[bytes, bool]:
        """(the int8 change from one version to another (shared/algorithms/sync.py), hash-checked; whether
        it was taken from the worker's copy: the run's update_feedback). `copy`: the copy_digest of the
        copy held, for a run with update_feedback; `max_bytes`: the most such an update weighs."""
        path = f"{protocol.API_PREFIX}/runs/{run}/updates/{from_version}/{to_version}"
        resp = self._download(f"{path}/{copy}" if copy else path, max_bytes=max_bytes,
                              expected="an update of the lease's model can weigh")
        if hashlib.sha256(resp.content).hexdigest() != resp.headers.get(protocol.H_SHA256, ""):
            raise IntegrityError(f"update {from_version}->{to_version} does not match its announced SHA-256")
        return resp.content, resp.headers.get(protocol.H_UPDATE_FEEDBACK) == "1"

    def shard(self, run: str, index: int, *, expected_sha256: str, max_bytes: int | None = None,
              max_raw_bytes: int = 1 << 30) -> bytes:
        """The raw tokens of a shard (little-endian ids of the lease's token_dtype), checked against the
        hash the lease announced; `max_bytes` caps its zstd frame, `max_raw_bytes` its tokens' bytes."""
        resp = self._download(f"{protocol.API_PREFIX}/runs/{run}/shards/{index}", max_bytes=max_bytes,
                              expected="a shard of the lease's token dtype can weigh")
        try:
            raw = zstandard.ZstdDecompressor().stream_reader(resp.content).read(max_raw_bytes + 1)
        except zstandard.ZstdError as exc:
            raise IntegrityError(f"shard {index} is not valid zstd: {exc}") from None
        if len(raw) > max_raw_bytes or hashlib.sha256(raw).hexdigest() != expected_sha256:
            raise IntegrityError(f"shard {index} does not match its announced SHA-256")
        return raw

    def tokenizer(self, run: str, *, expected_sha256: str, max_bytes: int | None = None) -> bytes:
        """The run's tokenizer.json, checked against the hash the lease announced; `max_bytes`: the most
        a tokenizer of the lease model's vocab weighs (its contents are checked by the caller)."""
        resp = self._download(f"{protocol.API_PREFIX}/runs/{run}/tokenizer", max_bytes=max_bytes,
                              expected="a tokenizer of the lease model's vocab can weigh")
        if hashlib.sha256(resp.content).hexdigest() != expected_sha256:
            raise IntegrityError(f"the tokenizer of run {run!r} does not match its announced SHA-256")
        return resp.content

    def renew(self, lease_id: int, *, step: int) -> protocol.LeaseRenewed:
        """Extend a live lease; `step` is the round's local step now (the coordinator renews a lease
        only while its round progresses: each renewal must report a later step than the last)."""
        resp = self._request("POST", f"{protocol.API_PREFIX}/leases/{lease_id}/renew", params={"step": step})
        return protocol.LeaseRenewed.model_validate(resp.json())

    def lease_standing(self, lease_id: int) -> protocol.LeaseStanding | None:
        """Whether a lease still stands (GET); None from a coordinator that cannot say (before 2026-12: 404/405)."""
        try:
            resp = self._request("GET", f"{protocol.API_PREFIX}/leases/{lease_id}", max_retries=1)
        except CoordinatorError as exc:
            if exc.status in (404, 405):
                return None
            raise
        return _parse(protocol.LeaseStanding, resp, "lease standing")

    def release(self, lease_id: int) -> None:
        """Give a lease up before training it (DELETE; coordinators before 2026-12 answer 405)."""
        self._request("DELETE", f"{protocol.API_PREFIX}/leases/{lease_id}", max_retries=1)

    def upload_delta(self, lease_id: int, body: bytes, *,
                     start_state: tuple[str, int] | None = None) -> protocol.DeltaAccepted:
        """UploadTooLarge (naming both sizes) when the body is over the coordinator's cap: refused
        here, without sending it, when its /healthz said the cap. `start_state`: (SHA-256, size) of
        the round's start state this worker keeps (worker/start_states.py), committed to here."""
        cap = self.max_upload_bytes
        if cap is not None and len(body) > cap:
            raise UploadTooLarge(413, f"not sent: {len(body)} bytes, over the cap of {cap} bytes its /healthz says",
                                 limit_bytes=cap, size_bytes=len(body))
        try:
            commit = {} if start_state is None else {protocol.H_START_STATE: start_state[0],
                                                     protocol.H_START_STATE_BYTES: str(start_state[1])}
            resp = self._request("POST", f"{protocol.API_PREFIX}/leases/{lease_id}/delta", content=body,
                                 headers={"Content-Type": "application/octet-stream", **commit})
        except UploadTooLarge as exc:
            exc.size_bytes = len(body)
            raise
        self.bytes_up += len(body)
        return _parse(protocol.DeltaAccepted, resp, "acknowledgement")

    def upload_start_state(self, lease_id: int, blob: bytes, *, exchanges_applied: str | None = None) -> None:
        """Send a spot-checked lease's committed start state (its acknowledgement asked for it), and for
        a sparta round where it applied its corrections (protocol.H_EXCHANGES_APPLIED)."""
        extra = {} if exchanges_applied is None else {protocol.H_EXCHANGES_APPLIED: exchanges_applied}
        self._request("PUT", f"{protocol.API_PREFIX}/leases/{lease_id}/start-state", content=blob,
                      headers={"Content-Type": "application/octet-stream", **extra})
        self.bytes_up += len(blob)

    def exchange(self, lease_id: int, step: int, body: bytes) -> bytes:
        """A sparse exchange (sparta) after local step `step`: sends the encoded values, returns the
        encoded correction. Few retries: an exchange is worth little once training has moved on. A
        retry after a lost answer is refused with 409 (the coordinator already mixed it in); the
        worker then simply goes without that correction."""
        resp = self._request("POST", f"{protocol.API_PREFIX}/leases/{lease_id}/exchange", params={"step": step},
                             content=body, headers={"Content-Type": "application/octet-stream"},
                             max_retries=self.EXCHANGE_RETRIES)
        self.bytes_up += len(body)
        sha = resp.headers.get(protocol.H_SHA256)
        if sha is not None and hashlib.sha256(resp.content).hexdigest() != sha:
            raise IntegrityError(f"exchange answer for step {step} does not match its announced SHA-256")
        self.bytes_down += len(resp.content)
        return resp.content

    def status(self, run: str) -> protocol.RunStatus:
        resp = self._request("GET", f"{protocol.API_PREFIX}/runs/{run}/status")
        return protocol.RunStatus.model_validate(resp.json())

    def runs(self, *, state: str = "active") -> list[protocol.RunSummary]:
        """The coordinator's runs in `state` (a worker following the whole coordinator picks among them)."""
        resp = self._request("GET", f"{protocol.API_PREFIX}/runs", params={"state": state})
        try:
            return [protocol.RunSummary.model_validate(r) for r in resp.json()]
        except (ValueError, TypeError) as exc:
            raise invalid_answer("list of runs", exc if isinstance(exc, ValueError) else ValueError(exc)) from None

    def run_config(self, run: str) -> dict:
        """The run's public config (JSON; the caller validates it)."""
        body = self._request("GET", f"{protocol.API_PREFIX}/runs/{run}/config").json()
        if not isinstance(body, dict):
            raise InvalidAnswer(f"the config of run {run!r} is not a JSON object")
        return body
