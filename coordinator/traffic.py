"""Bytes moved, counted in memory and written to the database in one transaction at a time.

Every download would otherwise update its run's row (the run's byte counters), and every
coordinator request of a busy run would queue on that one row. The counts are statistics (the
dashboard's traffic, the traffic ratio), not acknowledged work: the coordinator writes them every
second (and before it reads them), so a crash loses at most about a second of them.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from coordinator.db import Database
from coordinator.queries import runs as run_rows
from coordinator.queries import workers as worker_rows

RunBytes = dict[int, list[int]]  # run id -> [up, down_model, down_data]
WorkerBytes = dict[int, list[int]]  # worker id -> [up, down]


class TrafficCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: RunBytes = defaultdict(lambda: [0, 0, 0])
        self._workers: WorkerBytes = defaultdict(lambda: [0, 0])

    def add(self, run_id: int, worker_id: int | None = None, *, up: int = 0, down_model: int = 0,
            down_data: int = 0) -> None:
        with self._lock:
            r = self._runs[run_id]
            r[0] += up
            r[1] += down_model
            r[2] += down_data
            if worker_id is not None:
                w = self._workers[worker_id]
                w[0] += up
                w[1] += down_model + down_data

    def take(self) -> tuple[RunBytes, WorkerBytes]:
        """Everything counted since the last take (sorted by id: concurrent writers lock rows in one order)."""
        with self._lock:
            runs, workers = self._runs, self._workers
            self._runs, self._workers = defaultdict(lambda: [0, 0, 0]), defaultdict(lambda: [0, 0])
        return dict(sorted(runs.items())), dict(sorted(workers.items()))

    def put_back(self, runs: RunBytes, workers: WorkerBytes) -> None:
        """A write that failed: count it again, to go with the next one."""
        for run_id, (up, down_model, down_data) in runs.items():
            self.add(run_id, up=up, down_model=down_model, down_data=down_data)
        with self._lock:
            for worker_id, (up, down) in workers.items():
                w = self._workers[worker_id]
                w[0] += up
                w[1] += down


class Traffic(TrafficCounter):
    """The counter, and the write of what it counted (flush): every process flushes every second
    (app.Election), and whatever reads the counts flushes first."""

    def __init__(self, db: Database) -> None:
        super().__init__()
        self.db = db
        self._flush_lock = threading.Lock()

    def flush(self) -> None:
        """Write the bytes counted in this process since the last flush (one transaction). One flush at a
        time: a reader that flushes first then sees every count taken before it, written."""
        with self._flush_lock:
            runs, workers = self.take()
            if not runs and not workers:
                return
            try:
                with self.db.begin() as c:
                    for run_id, (up, down_model, down_data) in runs.items():
                        run_rows.add_traffic(c, run_id, up=up, down_model=down_model, down_data=down_data)
                    for worker_id, (up, down) in workers.items():
                        worker_rows.add_traffic(c, worker_id, up=up, down=down)
            except BaseException:
                self.put_back(runs, workers)
                raise
