"""Every statement the coordinator runs, by table, each behind a typed function over a Connection.

    runs.py       runs: create, look up, state, byte counters, epochs, the merger's version fence, the
                  lifecycle (options, finishing, finished), a run deleted with every row of it
    workers.py    workers and refusals: authentication, registration, the ledger, standing, judged events
    leases.py     leases and shards: grant (a shard picked and claimed in one UPDATE), renew, give up, expire
    deltas.py     received deltas: the upload's checks and acknowledgement, the merger's queue and outcomes
    versions.py   model versions (snapshots on disk) and evaluations; the download lookups
    exchanges.py  sparse exchanges (sparta): record, count, replay, prune their bodies
    spotchecks.py replay spot-checks: sampled at acknowledgement, the checker's queue, verdicts
    compensations.py merged deltas taken back after a failed spot-check, and where each was applied
    reports.py    the aggregates behind status, the dashboard and /metrics
    stats.py      contributors (claimed names, their forms) and daily stats: moved with the ledger, by day
    teams.py      registered teams: create, find by a name's forms, list, delete; a member's lease cap
    locks.py      PostgreSQL advisory locks: the merger lock (leader.py), the migration lock (migrate.py)

One way to the database: SQLAlchemy Core on a Connection (no ORM unit of work), the caller owning
the transaction (`engine.begin()`, or `engine.connect()` with explicit commits where a request
commits or rolls back part way). Statements of the hot path (authentication, leases, uploads) are
built once at import with named parameters: building a statement costs more CPU than running it
on a warm connection. Each round trip also does as much as one statement can: a shard is picked
and claimed in one UPDATE, a run's next sequence number taken and its counts moved in another.

Row locks are taken in one order, lease -> shard -> run -> worker (-> its daily_stats row): the merger's commit and the
traffic flush also lock the run's row before any worker's, so no two transactions wait on each
other in a circle.
"""
