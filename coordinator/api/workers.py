"""Workers: registration, leases, delta uploads, sparse exchanges."""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from starlette.requests import ClientDisconnect
from starlette.concurrency import run_in_threadpool

from coordinator import timing
from coordinator.api import relay
from coordinator.api.deps import AdminDep, CoordinatorDep, CurrentWorker, RowId
from coordinator.errors import PayloadTooLarge, RequestTimeout, ServiceError
from coordinator.ratelimit import client_key
from coordinator.storage import ReceivedBody
from shared import protocol

router = APIRouter(prefix=protocol.API_PREFIX, tags=["workers"])


@router.post("/runs/{run}/workers", status_code=201, response_model=protocol.RegisterResponse)
async def register(run: str, req: protocol.RegisterRequest, request: Request,
                   coord: CoordinatorDep) -> protocol.RegisterResponse:
    """Register a worker with a run; the token in the answer is shown only this once."""
    client = request.client.host if request.client else None
    return await run_in_threadpool(coord.register_worker, run, req, client=client)


@router.get("/runs/{run}/workers", response_model=list[protocol.WorkerInfo])
async def list_workers(run: str, coord: CoordinatorDep, _: AdminDep) -> list[protocol.WorkerInfo]:
    """Every worker of a run: contribution, standing (ok / throttled / banned) and why (operators)."""
    return await run_in_threadpool(coord.list_workers, run)


@router.post("/runs/{run}/workers/{worker_id}/revoke", response_model=protocol.WorkerInfo)
async def revoke_worker(run: str, worker_id: RowId, coord: CoordinatorDep, _: AdminDep) -> protocol.WorkerInfo:
    """Revoke a worker's token for good; its live lease goes back to the queue (operators)."""
    return await run_in_threadpool(coord.revoke_worker, run, worker_id)


@router.post("/runs/{run}/workers/{worker_id}/readmit", response_model=protocol.WorkerInfo)
async def readmit_worker(run: str, worker_id: RowId, coord: CoordinatorDep, _: AdminDep) -> protocol.WorkerInfo:
    """Lift a ban or throttle that robust merging imposed (operators)."""
    return await run_in_threadpool(coord.readmit_worker, run, worker_id)


@router.post("/runs/{run}/leases", response_model=protocol.Lease,
             responses={204: {"description": "no work right now; ask again after Retry-After seconds"}})
async def take_lease(run: str, request: Request, coord: CoordinatorDep, worker: CurrentWorker,
                     keep: Annotated[int | None, Query(ge=0, le=2**31 - 1, description=(
                         "this worker's lease whose delta is still uploading: it stays live; every other "
                         "earlier lease of the worker is given up"))] = None) -> protocol.Lease | Response:
    """Lease a data shard and the model version to train it from (429 while the requester's address
    holds max_leases_per_address live leases of the run)."""
    client = client_key(request.client.host if request.client else None)
    lease = await run_in_threadpool(coord.grant_lease, run, worker, keep=keep, client=client)
    if lease is None:
        return Response(status_code=204, headers={"Retry-After": "2"})
    return lease


_OCTET = {"requestBody": {"required": True, "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


@router.post("/leases/{lease_id}/renew", response_model=protocol.LeaseRenewed)
async def renew_lease(lease_id: RowId, coord: CoordinatorDep, worker: CurrentWorker,
                      step: Annotated[int | None, Query(ge=0, le=2**31 - 1, description=(
                          "the round's local step now; it must be past the one the last renewal reported"))]
                      = None) -> protocol.LeaseRenewed:
    """Extend a live lease by the run's lease_ttl_s while its round progresses (each renewal reports a
    later local step), up to the lease's lifetime cap (a few of the run's expected rounds)."""
    return await run_in_threadpool(coord.renew_lease, lease_id, worker, step=step)


@router.delete("/leases/{lease_id}", status_code=204, response_class=Response)
async def release_lease(lease_id: RowId, coord: CoordinatorDep, worker: CurrentWorker) -> Response:
    """Give a live lease up before training it (a worker stopping): its shard is free again at once."""
    await run_in_threadpool(coord.release_lease, lease_id, worker)
    return Response(status_code=204)


@router.post("/leases/{lease_id}/delta", status_code=202, response_model=protocol.DeltaAccepted,
             openapi_extra=_OCTET)
async def upload_delta(lease_id: RowId, request: Request, coord: CoordinatorDep,
                       worker: CurrentWorker) -> protocol.DeltaAccepted:
    """Upload the encoded delta of a lease. 202 once it is durably queued for merging.

    Before a byte of the body is read: the token (a dependency), the worker's uploads in flight
    (429 past max_concurrent_uploads), the rate limit and the lease (Coordinator.precheck_upload).
    The body then streams to a file in the run's deltas folder, hashed as it comes (413 once past
    max_upload_bytes, 408 when it stalls body_timeout_s), and only then is it checked and
    acknowledged; a refusal deletes the file, so nothing is kept."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip()
    if ctype != "application/octet-stream":
        raise ServiceError(f"send the delta as application/octet-stream, not {ctype or 'nothing'}")
    settings = coord.settings
    with coord.uploads_in_flight.hold(worker.id):
        run_id = await run_in_threadpool(coord.precheck_upload, lease_id, worker)
        path = coord.storage.receiving(run_id, lease_id)
        try:
            with timing.phase("body"):
                received = await receive_to_file(request, path, cap=settings.max_upload_bytes,
                                                 stall_s=settings.body_timeout_s)
            return await run_in_threadpool(functools.partial(coord.accept_delta, lease_id, worker, received,
                                                             prechecked=True))
        finally:
            path.unlink(missing_ok=True)  # refused or failed; an accepted body was renamed to its staged name


@router.post("/leases/{lease_id}/exchange", response_class=Response, openapi_extra=_OCTET, responses={
    200: {"content": {"application/octet-stream": {}}, "description": "the encoded correction (a delta envelope)"}})
async def exchange(lease_id: RowId, step: Annotated[int, Query(description="the local step just finished")],
                   request: Request, coord: CoordinatorDep, worker: CurrentWorker) -> Response:
    """A sparse exchange with the global model (algorithms sparta and sparta+diloco): the body is
    the worker's values at this step's seeded indices, the answer the correction it subtracts."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip()
    if ctype != "application/octet-stream":
        raise ServiceError(f"send the exchange as application/octet-stream, not {ctype or 'nothing'}")
    settings = coord.settings
    with coord.exchanges_in_flight.hold(worker.id):  # 429 past max_concurrent_exchanges, before the body
        await run_in_threadpool(coord.precheck_exchange, lease_id, worker)
        body = await read_capped(request, settings.max_upload_bytes, stall_s=settings.body_timeout_s)
        if not coord.leads:  # the live model is in another coordinator process
            return await relay.forward(request, body, coord)
        answer = await run_in_threadpool(coord.exchange, lease_id, step, worker, body)
    return Response(answer, media_type="application/octet-stream",
                    headers={protocol.H_SHA256: hashlib.sha256(answer).hexdigest()})


async def read_capped(request: Request, cap: int, *, stall_s: float | None = None) -> bytes:
    """The request body, refused with 413 as soon as it passes `cap` bytes (counted while streaming)
    and with 408 when no byte comes for `stall_s` seconds."""
    chunks: list[bytes] = []
    await _receive(request, chunks.append, cap=cap, stall_s=stall_s)
    return b"".join(chunks)


async def receive_to_file(request: Request, path: Path, *, cap: int, stall_s: float | None) -> ReceivedBody:
    """The request body written to `path` as it arrives (never whole in memory) and hashed on the way;
    413 past `cap` bytes, 408 after `stall_s` seconds without a byte. The file is not fsynced (that
    waits until the body passed its checks: Storage.stage_received); on a refusal it is left for the
    caller to delete."""
    digest = hashlib.sha256()
    with open(path, "xb") as f:
        def sink(chunk: bytes) -> None:
            digest.update(chunk)
            f.write(chunk)

        size = await _receive(request, sink, cap=cap, stall_s=stall_s)
    return ReceivedBody(path=path, sha256=digest.hexdigest(), size=size)


async def _receive(request: Request, sink: Callable[[bytes], object], *, cap: int, stall_s: float | None) -> int:
    """Feed the body's chunks to `sink`; returns its size. 413 before reading a byte when
    Content-Length says more than `cap`, else as soon as the count passes it; 408 when the next
    chunk takes more than `stall_s` seconds (a slow client holds a connection, a task and what it
    sent so far: 200 slow connections were never timed out)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the limit of {cap} bytes")
    size = 0
    stream = request.stream()
    try:
        while True:
            try:
                async with asyncio.timeout(stall_s):
                    chunk = await anext(stream)
            except StopAsyncIteration:
                return size
            except TimeoutError:
                raise RequestTimeout(f"the body stopped arriving: no byte for {stall_s:g} s after {size} bytes; "
                                     "send it again") from None
            size += len(chunk)
            if size > cap:
                raise PayloadTooLarge(f"body exceeds the limit of {cap} bytes")
            sink(chunk)
    except ClientDisconnect:  # the worker went away mid-upload: nothing was received, nothing changes
        raise ServiceError("the upload was cut off before its end; send it again") from None
    finally:
        await stream.aclose()
