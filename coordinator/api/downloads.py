"""Binary downloads (DownloadService): model snapshots (immutable, cacheable), model updates, data shards,
the run's tokenizer."""

from __future__ import annotations

import functools
from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from starlette.concurrency import run_in_threadpool

from coordinator.api.deps import CoordinatorDep, CurrentWorker, RowId
from coordinator.errors import Unprocessable
from shared import protocol

router = APIRouter(prefix=protocol.API_PREFIX, tags=["downloads"])

_BINARY = {200: {"content": {"application/octet-stream": {}}, "description": "zstd-compressed bytes"}}


@router.get("/runs/{run}/snapshots/{version}", response_class=Response, responses=_BINARY)
async def snapshot(run: str, request: Request, coord: CoordinatorDep,
                   version: Annotated[str, Path(pattern=r"^(latest|\d{1,18})$")]) -> Response:
    """The model at `version` (or `latest`) as zstd-compressed safetensors."""
    if version != "latest" and not version.isdigit():
        raise Unprocessable("version must be a number or 'latest'")
    blob, v, sha = await run_in_threadpool(coord.downloads.snapshot, run, version,
                                           if_none_match=request.headers.get("if-none-match"))
    etag = f'"{sha}"'
    headers = {protocol.H_SHA256: sha, protocol.H_VERSION: str(v), "ETag": etag}
    # A numbered version never changes; `latest` moves with every merge.
    headers["Cache-Control"] = "no-cache" if version == "latest" else "public, max-age=31536000, immutable"
    if blob is None:  # If-None-Match names this version: the client's copy is current (and nothing is counted)
        return Response(status_code=304, headers=headers)
    return Response(blob, media_type="application/octet-stream", headers=headers)


@router.get("/runs/{run}/updates/{from_version}/{to_version}", response_class=Response, responses=_BINARY)
async def model_update(run: str, from_version: RowId, to_version: RowId, coord: CoordinatorDep) -> Response:
    """The change from one version to a later one, int8 (a delta envelope: add it to version
    `from_version`'s weights). 410 when `from_version` is no longer kept: fetch the snapshot.
    With the run's update_feedback it is taken from version `from_version` as a worker's copy, and
    says so in X-Update-Feedback: 1."""
    return await _update(coord, run, from_version, to_version, None)


@router.get("/runs/{run}/updates/{from_version}/{to_version}/{copy}", response_class=Response, responses=_BINARY)
async def model_update_from_copy(run: str, from_version: RowId, to_version: RowId, coord: CoordinatorDep,
                                 copy: Annotated[str, Path(pattern=protocol.SHA256_PATTERN)],
                                 worker: CurrentWorker) -> Response:
    """A run with update_feedback: the change from the worker's copy of version `from_version` whose
    copy_digest is `copy` (shared/algorithms/sync.py), X-Update-Feedback: 1; 410 when that copy is not
    kept (fetch the snapshot). A run without: the same as without `copy`. Workers of the run only: each
    answer is built for it (and keeps a copy)."""
    return await _update(coord, run, from_version, to_version, copy, worker)


async def _update(coord, run: str, from_version: int, to_version: int, copy: str | None,
                  worker=None) -> Response:
    blob, sha, feedback = await run_in_threadpool(
        functools.partial(coord.downloads.model_update, run, from_version, to_version, copy=copy, worker=worker))
    headers = {protocol.H_SHA256: sha, protocol.H_VERSION: str(to_version), "ETag": f'"{sha}"',
               "Cache-Control": "public, max-age=31536000, immutable"}
    if feedback:
        headers[protocol.H_UPDATE_FEEDBACK] = "1"
    return Response(blob, media_type="application/octet-stream", headers=headers)


@router.get("/runs/{run}/shards/{shard}", response_class=Response, responses=_BINARY)
async def shard(run: str, shard: RowId, coord: CoordinatorDep,
                worker: CurrentWorker) -> Response:
    """A data shard: zstd-compressed little-endian token ids (the lease's token_dtype: uint8 bytes, uint16
    or uint32); X-Content-SHA256 is of the raw ids."""
    blob, sha = await run_in_threadpool(coord.downloads.shard, run, shard, worker)
    return Response(blob, media_type="application/octet-stream",
                    headers={protocol.H_SHA256: sha, "Cache-Control": "private, max-age=31536000, immutable"})


@router.get("/runs/{run}/tokenizer", response_class=Response,
            responses={200: {"content": {"application/json": {}}, "description": "the run's tokenizer.json"}})
async def tokenizer(run: str, request: Request, coord: CoordinatorDep) -> Response:
    """The run's tokenizer (a Hugging Face tokenizers JSON file: `bytes` or BPE); ETag and
    X-Content-SHA256 are its SHA-256, which the lease announces (Lease.tokenizer_sha256)."""
    blob, sha = await run_in_threadpool(coord.downloads.tokenizer, run,
                                        if_none_match=request.headers.get("if-none-match"))
    headers = {protocol.H_SHA256: sha, "ETag": f'"{sha}"', "Cache-Control": "public, max-age=31536000, immutable"}
    if blob is None:
        return Response(status_code=304, headers=headers)
    return Response(blob, media_type="application/json", headers=headers)
