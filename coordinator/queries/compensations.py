"""Compensations: merged deltas taken back after a failed spot-check, and where each was applied."""

from __future__ import annotations

from sqlalchemy import Connection, Row, func, insert, select, update

from coordinator.models import Compensation, DeltaRecord

LOST = 0  # before_version of a compensation whose kept bytes were gone when its turn came: never applied


def add(c: Connection, *, run_id: int, seq: int, reason: str) -> float | None:
    """Queue merged delta `seq` of the run to be taken back; returns what it had moved the weights by
    (deltas.applied), or None when there is nothing to take back: it was not merged, it moved nothing,
    it merged before that was recorded, or it is queued already."""
    applied = c.scalar(select(DeltaRecord.applied).where(DeltaRecord.run_id == run_id, DeltaRecord.seq == seq,
                                                         DeltaRecord.outcome == "merged"))
    if not applied:
        return None
    if c.scalar(select(Compensation.id).where(Compensation.run_id == run_id, Compensation.seq == seq)) is not None:
        return None
    c.execute(insert(Compensation).values(run_id=run_id, seq=seq, applied=applied, reason=reason))
    return applied


def pending(c: Connection, run_id: int) -> list[Row]:
    """(id, seq, applied) of the run's compensations not applied yet, in the order they are applied."""
    return list(c.execute(select(Compensation.id, Compensation.seq, Compensation.applied)
                          .where(Compensation.run_id == run_id, Compensation.before_version.is_(None))
                          .order_by(Compensation.seq)))


def applied_before(c: Connection, run_id: int, ids: list[int], version: int) -> None:
    """Record that compensations `ids` were applied just before version `version` was merged."""
    if ids:
        c.execute(update(Compensation).where(Compensation.run_id == run_id, Compensation.id.in_(ids))
                  .values(before_version=version))


def at(c: Connection, run_id: int, first: int, last: int) -> dict[int, list[tuple[int, float]]]:
    """The compensations applied before versions first..last: version -> [(seq, applied)], in order."""
    out: dict[int, list[tuple[int, float]]] = {}
    for version, seq, applied in c.execute(
            select(Compensation.before_version, Compensation.seq, Compensation.applied)
            .where(Compensation.run_id == run_id, Compensation.before_version.between(first, last))
            .order_by(Compensation.before_version, Compensation.seq)):
        out.setdefault(version, []).append((seq, applied))
    return out


def held_since(c: Connection, run_id: int, after: int, through: int) -> list[int]:
    """The seqs of compensations applied before versions after+1..through (the checkpoints now hold
    them; those up to `after` were held, and their bytes deleted, at an earlier pruning)."""
    return list(c.scalars(select(Compensation.seq).where(Compensation.run_id == run_id,
                                                         Compensation.before_version > after,
                                                         Compensation.before_version <= through)))


def count(c: Connection, run_id: int) -> int:
    return int(c.scalar(select(func.count()).select_from(Compensation).where(Compensation.run_id == run_id)))
