"""Sparse exchanges (ExchangeService): answered by the process holding the live model, relayed there
by the others (coordinator/api/relay.py)."""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from coordinator.api import relay
from coordinator.api.bodies import OCTET, read_capped, require_octet_stream
from coordinator.api.deps import CoordinatorDep, CurrentWorker, RowId
from shared import protocol

router = APIRouter(prefix=protocol.API_PREFIX, tags=["exchanges"])


@router.post("/leases/{lease_id}/exchange", response_class=Response, openapi_extra=OCTET, responses={
    200: {"content": {"application/octet-stream": {}}, "description": "the encoded correction (a delta envelope)"}})
async def exchange(lease_id: RowId, step: Annotated[int, Query(description="the local step just finished")],
                   request: Request, coord: CoordinatorDep, worker: CurrentWorker) -> Response:
    """A sparse exchange with the global model (algorithms sparta and sparta+diloco): the body is
    the worker's values at this step's seeded indices, the answer the correction it subtracts."""
    require_octet_stream(request, "the exchange")
    settings, exchanges = coord.settings, coord.exchanges
    with exchanges.in_flight.hold(worker.id):  # 429 past max_concurrent_exchanges, before the body
        await run_in_threadpool(exchanges.precheck, lease_id, worker)
        body = await read_capped(request, settings.max_upload_bytes, stall_s=settings.body_timeout_s)
        if not coord.live.leads:  # the live model is in another coordinator process
            return await relay.forward(request, body, coord)
        answer = await run_in_threadpool(exchanges.exchange, lease_id, step, worker, body)
    return Response(answer, media_type="application/octet-stream",
                    headers={protocol.H_SHA256: hashlib.sha256(answer).hexdigest()})
