"""Model versions (the snapshots on disk) and evaluations; the lookups of the downloads."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

from sqlalchemy import Connection, Row, and_, bindparam, delete, func, insert, select

from coordinator.models import EvalResult, ModelVersion, Run, Shard


def newest_snapshot(run_id):
    """The newest version with a snapshot on disk (0 before any): what leases hand out and
    `snapshots/latest` serves. `run_id`: a value, a parameter or a column to correlate with."""
    return (select(func.coalesce(func.max(ModelVersion.version), 0)).where(ModelVersion.run_id == run_id)
            .scalar_subquery())


def _snapshot_of(*, latest: bool):
    """A version's snapshot row with its run's: the newest version with a snapshot on disk when
    `latest`, else the version given. Columns: run_id, state, run_version, version (the one looked
    for), sha256 (None when that version has no snapshot); no row: no such run."""
    wanted = newest_snapshot(Run.id).correlate(Run) if latest else bindparam("version", type_=ModelVersion.version.type)
    return (select(Run.id.label("run_id"), Run.state, Run.version.label("run_version"), wanted.label("version"),
                   ModelVersion.sha256)
            .outerjoin(ModelVersion, and_(ModelVersion.run_id == Run.id, ModelVersion.version == wanted))
            .where(Run.name == bindparam("name")))


_SNAPSHOT_LATEST = _snapshot_of(latest=True)
_SNAPSHOT_AT = _snapshot_of(latest=False)
# a shard's digest with its run's (no shard row: the run has no such shard; no row: no such run)
_SHARD_OF = (select(Run.id.label("run_id"), Run.state, Shard.index, Shard.sha256)
             .outerjoin(Shard, and_(Shard.run_id == Run.id, Shard.index == bindparam("index")))
             .where(Run.name == bindparam("name")))


def snapshot_of(c: Connection, run_name: str, version: int | None) -> Row | None:
    """(run_id, state, run_version, version, sha256) of a run's snapshot at `version` (None: the newest
    on disk); sha256 is None when that version has none; no row: no such run."""
    if version is None:
        return c.execute(_SNAPSHOT_LATEST, {"name": run_name}).first()
    return c.execute(_SNAPSHOT_AT, {"name": run_name, "version": version}).first()


def shard_of(c: Connection, run_name: str, index: int) -> Row | None:
    """(run_id, state, index, sha256) of a run's shard; index and sha256 are None when it has no such
    shard; no row: no such run."""
    return c.execute(_SHARD_OF, {"name": run_name, "index": index}).first()


def newest(c: Connection, run_id: int) -> int:
    """The newest version of the run with a snapshot on disk (0 before any)."""
    return c.scalar(select(newest_snapshot(run_id)))


def has(c: Connection, run_id: int, version: int) -> bool:
    return c.scalar(select(ModelVersion.id).where(ModelVersion.run_id == run_id,
                                                  ModelVersion.version == version)) is not None


def kept(c: Connection, run_id: int, versions: Collection[int]) -> set[int]:
    """Which of `versions` have a snapshot on disk."""
    return set(c.scalars(select(ModelVersion.version).where(ModelVersion.run_id == run_id,
                                                            ModelVersion.version.in_(list(versions)))))


def older_than(c: Connection, run_id: int, version: int) -> list[int]:
    return list(c.scalars(select(ModelVersion.version).where(ModelVersion.run_id == run_id,
                                                             ModelVersion.version < version)))


def record(c: Connection, *, run_id: int, version: int, sha256: str, size: int) -> None:
    """A snapshot written for `version`."""
    c.execute(insert(ModelVersion).values(run_id=run_id, version=version, sha256=sha256, size_bytes=size))


def forget(c: Connection, run_id: int, versions: Collection[int]) -> None:
    c.execute(delete(ModelVersion).where(ModelVersion.run_id == run_id, ModelVersion.version.in_(list(versions))))


def eval_at(c: Connection, run_id: int, version: int) -> Row | None:
    """(loss, tokens_trained, at) of the run's evaluation at `version`."""
    return c.execute(select(EvalResult.loss, EvalResult.tokens_trained, EvalResult.at).where(
        EvalResult.run_id == run_id, EvalResult.version == version)).first()


def record_eval(c: Connection, *, run_id: int, version: int, loss: float, tokens_trained: int,
                at: datetime) -> None:
    c.execute(insert(EvalResult).values(run_id=run_id, version=version, loss=loss, tokens_trained=tokens_trained,
                                        at=at))


def evals(c: Connection, run_id: int) -> list[Row]:
    """(version, loss, tokens_trained, at) of each of the run's evaluations, by version."""
    return list(c.execute(select(EvalResult.version, EvalResult.loss, EvalResult.tokens_trained, EvalResult.at)
                          .where(EvalResult.run_id == run_id).order_by(EvalResult.version)))
