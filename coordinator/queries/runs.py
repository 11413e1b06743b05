"""Runs (and their shards, at creation): create, look up, state, byte counters, epochs, the merger's
version fence, the lifecycle (options, finishing, finished) and deleting a run with every row of it."""

from __future__ import annotations

from collections.abc import Collection

from datetime import datetime

from sqlalchemy import Connection, Row, Table, bindparam, delete, insert, select, update

from coordinator.models import Base, Lease, Run, Shard

LIVE_STATES = ("active", "paused", "finishing")  # runs with a live model: the merger may still merge their deltas
_RUN = select(Run.__table__)
_BY_NAME = _RUN.where(Run.name == bindparam("name"))
_BY_ID = _RUN.where(Run.id == bindparam("run"))
# what a lease request reads of its run
_FOR_LEASE = select(Run.id, Run.name, Run.state, Run.epoch, Run.tokens_trained, Run.config_json, Run.token_budget,
                    Run.max_epochs).where(Run.name == bindparam("name"))
# Takes the run's row lock (until the commit): sequence numbers follow the commit order, no gaps.
_DELIVERED = (update(Run).where(Run.id == bindparam("run"), Run.state.in_(LIVE_STATES)).values(
    next_seq=Run.next_seq + 1,
    tokens_trained=Run.tokens_trained + bindparam("tokens", type_=Run.tokens_trained.type),
    worker_steps=Run.worker_steps + bindparam("steps", type_=Run.worker_steps.type),
    bytes_up=Run.bytes_up + bindparam("size", type_=Run.bytes_up.type))
    .returning(Run.next_seq))


def by_name(c: Connection, name: str) -> Row | None:
    """Every column of the run named `name` (any state)."""
    return c.execute(_BY_NAME, {"name": name}).first()


def by_id(c: Connection, run_id: int) -> Row | None:
    return c.execute(_BY_ID, {"run": run_id}).first()


def for_lease(c: Connection, name: str) -> Row | None:
    """(id, name, state, epoch, tokens_trained, config_json, token_budget, max_epochs) of the run named `name`."""
    return c.execute(_FOR_LEASE, {"name": name}).first()


def id_of(c: Connection, name: str) -> int | None:
    return c.scalar(select(Run.id).where(Run.name == name))


def insert_creating(c: Connection, *, name: str, config_json: str, n_params: int, train_tokens: int,
                    eval_tokens: int, join_key_hash: str | None, token_budget: int | None = None,
                    max_epochs: int | None = None, priority: int = 0) -> int:
    """A new run in state "creating" (not served until activate()); returns its id."""
    return c.execute(insert(Run).values(
        name=name, config_json=config_json, n_params=n_params, train_tokens=train_tokens, eval_tokens=eval_tokens,
        join_key_hash=join_key_hash, state="creating", token_budget=token_budget, max_epochs=max_epochs,
        priority=priority).returning(Run.id)).scalar_one()


def add_shards(c: Connection, rows: list[dict]) -> None:
    """A new run's shards: dicts of run_id, index, n_tokens, sha256."""
    c.execute(insert(Shard), rows)


def set_state(c: Connection, run_id: int, state: str) -> None:
    c.execute(update(Run).where(Run.id == run_id).values(state=state))


def created(c: Connection, *, besides: Collection[int] = ()) -> list[Row]:
    """Every column of each run past creation and not yet finished (but those in `besides`), by id."""
    query = _RUN.where(Run.state.in_(LIVE_STATES))
    if besides:
        query = query.where(Run.id.not_in(list(besides)))
    return list(c.execute(query.order_by(Run.id)))


def created_ids(c: Connection) -> list[int]:
    return list(c.scalars(select(Run.id).where(Run.state != "creating").order_by(Run.id)))


def every(c: Connection) -> list[Row]:
    """Every column of every run (creating ones too), by id."""
    return list(c.execute(_RUN.order_by(Run.id)))


def version(c: Connection, run_id: int) -> int | None:
    return c.scalar(select(Run.version).where(Run.id == run_id))


def add_traffic(c: Connection, run_id: int, *, up: int, down_model: int, down_data: int) -> None:
    c.execute(update(Run).where(Run.id == run_id).values(
        bytes_up=Run.bytes_up + up, bytes_down_model=Run.bytes_down_model + down_model,
        bytes_down_data=Run.bytes_down_data + down_data))


def open_epoch(c: Connection, run_id: int, epoch: int) -> bool:
    """Every shard was done: move the run from `epoch` to the next and put its shards back to pending.
    False when another request opened it first (nothing changes then)."""
    opened = c.execute(update(Run).where(Run.id == run_id, Run.epoch == epoch).values(epoch=Run.epoch + 1)).rowcount
    if opened:
        c.execute(update(Shard).where(Shard.run_id == run_id, Shard.state == "done").values(state="pending"))
    return bool(opened)


def delivered(c: Connection, run_id: int, *, tokens: int, steps: int, size: int) -> int | None:
    """Count a delivered delta in its run (taking the run's row lock); returns the delta's sequence number.
    None when the run is finished (or archived): nothing is counted, the delta is not taken."""
    seq = c.execute(_DELIVERED, {"run": run_id, "tokens": tokens, "steps": steps, "size": size}).scalar_one_or_none()
    return None if seq is None else seq - 1


def advance_version(c: Connection, run_id: int, *, first: int, last: int) -> bool:
    """The merger's fence: the version moves to `last` only from `first - 1`, the one the batch followed.
    False when it was not there (another process merged): a process that lost the merger lock without
    knowing it yet cannot merge a delta twice."""
    return bool(c.execute(update(Run).where(Run.id == run_id, Run.version == first - 1)
                          .values(version=last)).rowcount)


# -- the lifecycle ------------------------------------------------------------------------------

def set_options(c: Connection, run_id: int, *, config_json: str, token_budget: int | None, max_epochs: int | None,
                priority: int) -> None:
    """The run's lifecycle options (and its config, which states them too)."""
    c.execute(update(Run).where(Run.id == run_id).values(config_json=config_json, token_budget=token_budget,
                                                         max_epochs=max_epochs, priority=priority))


def start_finishing(c: Connection, run_id: int, *, finish_by: datetime | None,
                    states: Collection[str] = ("active", "paused")) -> bool:
    """Move the run from one of `states` to "finishing" (no new leases); False when it was in none of them."""
    return bool(c.execute(update(Run).where(Run.id == run_id, Run.state.in_(list(states)))
                          .values(state="finishing", finish_by=finish_by)).rowcount)


def mark_finished(c: Connection, run_id: int, at: datetime, *, next_seq: int) -> bool:
    """finishing -> finished, only while no delta was acknowledged since the run's next sequence number
    was `next_seq`; False otherwise (a late delivery came in: merge it first) or when it was not finishing."""
    return bool(c.execute(update(Run).where(Run.id == run_id, Run.state == "finishing", Run.next_seq == next_seq)
                          .values(state="finished", finished_at=at, finish_by=None)).rowcount)


def _rows_of(table: Table, run_id: int):
    """The condition selecting `table`'s rows that belong to the run: by its run_id column, else by a
    foreign key to a row of a table that has one (a worker, a lease, a delta of the run). None: the
    table holds nothing of a run (rows across runs, such as a contributor's claimed name, stay)."""
    if "run_id" in table.c:
        return table.c.run_id == run_id
    for fk in table.foreign_keys:
        owner = fk.column.table
        if "run_id" in owner.c:
            return fk.parent.in_(select(fk.column).where(owner.c.run_id == run_id))
    return None


def delete_run(c: Connection, run_id: int) -> dict[str, int]:
    """Every row of the run, in every table (children first), then the run's own; returns rows per table."""
    gone: dict[str, int] = {}
    for table in reversed(Base.metadata.sorted_tables):
        if table.name == "runs":
            continue
        cond = _rows_of(table, run_id)
        if cond is not None:
            gone[table.name] = c.execute(delete(table).where(cond)).rowcount
    gone["runs"] = c.execute(delete(Run).where(Run.id == run_id)).rowcount
    return gone


def live_lease_rows(c: Connection, run_id: int) -> list[Row]:
    """(id, shard_id) of the run's leases still out."""
    return list(c.execute(select(Lease.id, Lease.shard_id).where(Lease.run_id == run_id, Lease.state == "active")))
