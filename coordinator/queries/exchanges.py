"""Sparse exchanges (sparta): record, look up, replay, prune their bodies."""

from __future__ import annotations

from sqlalchemy import Connection, Row, insert, select, update

from coordinator.models import Exchange, SpotCheck


def exists(c: Connection, lease_id: int, step: int) -> bool:
    return c.scalar(select(Exchange.id).where(Exchange.lease_id == lease_id, Exchange.step == step)) is not None


def record(c: Connection, *, run_id: int, lease_id: int, worker_id: int, step: int, after_version: int,
           body: bytes, bytes_out: int, centre_scale: float, answer: bytes | None = None) -> int:
    """An answered exchange, with its body and the version it followed (a restart replays it in its
    place), and its answer when its lease will be spot-checked; returns its id. Raises IntegrityError
    when the lease exchanged after this step already."""
    return c.execute(insert(Exchange).values(
        run_id=run_id, lease_id=lease_id, worker_id=worker_id, step=step, after_version=after_version, body=body,
        bytes_in=len(body), bytes_out=bytes_out, centre_scale=centre_scale, answer=answer)
        .returning(Exchange.id)).scalar_one()


def after(c: Connection, run_id: int, version: int, *, after_id: int) -> list[Row]:
    """(id, body, worker_id, step, centre_scale) of the run's exchanges that followed `version`, newer than
    `after_id`, by id."""
    return list(c.execute(select(Exchange.id, Exchange.body, Exchange.worker_id, Exchange.step,
                                 Exchange.centre_scale).where(
        Exchange.run_id == run_id, Exchange.after_version == version, Exchange.id > after_id)
        .order_by(Exchange.id)))


def drop_bodies(c: Connection, run_id: int, *, from_version: int, before_version: int) -> None:
    """Empty the bodies of the exchanges that followed versions from..before (their rows stay: they
    are counted, and keep a retried exchange from being applied twice), but for those of a lease
    whose spot-check is pending (its replay compares them: drop_checked empties them once judged)."""
    checking = select(SpotCheck.lease_id).where(SpotCheck.run_id == run_id, SpotCheck.verdict == "pending")
    c.execute(update(Exchange).where(Exchange.run_id == run_id, Exchange.after_version >= from_version,
                                     Exchange.after_version < before_version, Exchange.lease_id.not_in(checking))
              .values(body=b""))


def drop_checked(c: Connection, lease_id: int, *, before_version: int) -> None:
    """A judged spot-check's exchanges: their answers go, and the bodies it kept (drop_bodies) that the
    run's pruning has passed."""
    c.execute(update(Exchange).where(Exchange.lease_id == lease_id).values(answer=None))
    c.execute(update(Exchange).where(Exchange.lease_id == lease_id, Exchange.after_version < before_version)
              .values(body=b""))


def of_lease(c: Connection, lease_id: int) -> list[Row]:
    """(step, body, answer) of a lease's exchanges, by step (a body emptied by pruning is b"")."""
    return list(c.execute(select(Exchange.step, Exchange.body, Exchange.answer).where(Exchange.lease_id == lease_id)
                          .order_by(Exchange.step)))
