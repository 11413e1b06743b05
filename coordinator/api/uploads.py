"""Delta uploads (UploadService): the body streamed to a file as it arrives, then checked and acknowledged."""

from __future__ import annotations

import functools
import re

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from coordinator import timing
from coordinator.api.bodies import OCTET, receive_to_file, require_octet_stream
from coordinator.api.deps import CoordinatorDep, CurrentWorker, RowId
from coordinator.errors import ServiceError
from shared import protocol
from shared.algorithms import spotcheck as spotcheck_math

router = APIRouter(prefix=protocol.API_PREFIX, tags=["uploads"])


@router.post("/leases/{lease_id}/delta", status_code=202, response_model=protocol.DeltaAccepted,
             response_model_exclude_defaults=True, openapi_extra=OCTET)
async def upload_delta(lease_id: RowId, request: Request, coord: CoordinatorDep,
                       worker: CurrentWorker) -> protocol.DeltaAccepted:
    """Upload the encoded delta of a lease. 202 once it is durably queued for merging.

    Before a byte of the body is read: the token (a dependency), the worker's uploads in flight
    (429 past max_concurrent_uploads), the rate limit and the lease (UploadService.precheck).
    The body then streams to a file in the run's deltas folder, hashed as it comes (413 once past
    max_upload_bytes, 408 when it stalls body_timeout_s), and only then is it checked and
    acknowledged; a refusal deletes the file, so nothing is kept."""
    require_octet_stream(request, "the delta")
    commitment = start_commitment(request)
    settings, uploads = coord.settings, coord.uploads
    with uploads.in_flight.hold(worker.id):
        run_id = await run_in_threadpool(uploads.precheck, lease_id, worker)
        path = coord.storage.receiving(run_id, lease_id)
        try:
            with timing.phase("body"):
                received = await receive_to_file(request, path, cap=settings.max_upload_bytes,
                                                 stall_s=settings.body_timeout_s)
            return await run_in_threadpool(functools.partial(uploads.accept, lease_id, worker, received,
                                                             prechecked=True, commitment=commitment))
        finally:
            path.unlink(missing_ok=True)  # refused or failed; an accepted body was renamed to its staged name


def start_commitment(request: Request) -> tuple[str, int] | None:
    """The upload's commitment to its round's start state (protocol.H_START_STATE and _BYTES), checked
    for its form (400 on a malformed one); None when the worker made none (API 4 and older)."""
    sha, size = request.headers.get(protocol.H_START_STATE), request.headers.get(protocol.H_START_STATE_BYTES)
    if sha is None and size is None:
        return None
    if sha is None or size is None or not re.fullmatch(protocol.SHA256_PATTERN[1:-1], sha) \
            or not size.isdigit() or not 0 < int(size) <= protocol.MAX_ID:
        raise ServiceError(f"{protocol.H_START_STATE} must be a lowercase hex SHA-256 and "
                           f"{protocol.H_START_STATE_BYTES} a size in bytes, both or neither")
    return sha, int(size)


@router.put("/leases/{lease_id}/start-state", status_code=204, response_class=Response, openapi_extra=OCTET)
async def upload_start_state(lease_id: RowId, request: Request, coord: CoordinatorDep,
                             worker: CurrentWorker) -> Response:
    """Send the start state a spot-checked lease's upload committed to (its acknowledgement said
    `start_state_wanted`); a sparta round's says where it applied its corrections
    (X-Exchanges-Applied; 400 when malformed). 404 when it is not wanted, 413 past the committed
    size, 409 when the bytes are not the committed ones; 204 once kept (again for the same bytes)."""
    require_octet_stream(request, "the start state")
    applied = request.headers.get(protocol.H_EXCHANGES_APPLIED)
    if applied is not None:
        try:
            spotcheck_math.parse_applied(applied)
        except ValueError as exc:
            raise ServiceError(f"{protocol.H_EXCHANGES_APPLIED}: {exc}") from None
    row = await run_in_threadpool(coord.spotchecks.state_wanted, lease_id, worker)
    path = coord.storage.receiving(row.run_id, lease_id)
    try:
        received = await receive_to_file(request, path, cap=row.state_bytes, stall_s=coord.settings.body_timeout_s)
        await run_in_threadpool(coord.spotchecks.receive_start_state, lease_id, worker, received,
                                exchanges_applied=applied)
    finally:
        path.unlink(missing_ok=True)
    return Response(status_code=204)
