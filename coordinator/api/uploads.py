"""Delta uploads (UploadService): the body streamed to a file as it arrives, then checked and acknowledged."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from coordinator import timing
from coordinator.api.bodies import OCTET, receive_to_file, require_octet_stream
from coordinator.api.deps import CoordinatorDep, CurrentWorker, RowId
from shared import protocol

router = APIRouter(prefix=protocol.API_PREFIX, tags=["uploads"])


@router.post("/leases/{lease_id}/delta", status_code=202, response_model=protocol.DeltaAccepted,
             openapi_extra=OCTET)
async def upload_delta(lease_id: RowId, request: Request, coord: CoordinatorDep,
                       worker: CurrentWorker) -> protocol.DeltaAccepted:
    """Upload the encoded delta of a lease. 202 once it is durably queued for merging.

    Before a byte of the body is read: the token (a dependency), the worker's uploads in flight
    (429 past max_concurrent_uploads), the rate limit and the lease (UploadService.precheck).
    The body then streams to a file in the run's deltas folder, hashed as it comes (413 once past
    max_upload_bytes, 408 when it stalls body_timeout_s), and only then is it checked and
    acknowledged; a refusal deletes the file, so nothing is kept."""
    require_octet_stream(request, "the delta")
    settings, uploads = coord.settings, coord.uploads
    with uploads.in_flight.hold(worker.id):
        run_id = await run_in_threadpool(uploads.precheck, lease_id, worker)
        path = coord.storage.receiving(run_id, lease_id)
        try:
            with timing.phase("body"):
                received = await receive_to_file(request, path, cap=settings.max_upload_bytes,
                                                 stall_s=settings.body_timeout_s)
            return await run_in_threadpool(functools.partial(uploads.accept, lease_id, worker, received,
                                                             prechecked=True))
        finally:
            path.unlink(missing_ok=True)  # refused or failed; an accepted body was renamed to its staged name
