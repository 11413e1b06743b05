"""The live models this process holds (only while it leads: coordinator/leader.py), and each run's
tensor schema, which any process needs to check an upload."""

from __future__ import annotations

import threading

from coordinator.db import Database
from coordinator.errors import NotFound
from coordinator.leader import Leadership
from coordinator.queries import runs as run_rows
from coordinator.runtime import RunRuntime
from shared import kernels
from shared.config import RunConfig
from shared.model import ModelConfig, meta_schema


class LiveRuns:
    """run id -> RunRuntime, with whether this process leads (`leads`, set by the app from the merger
    lock) and the lock itself (`leadership`, when the app took one)."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.runtimes: dict[int, RunRuntime] = {}
        self._lock = threading.Lock()
        self.leads = True  # whether this process holds the live models
        self.leadership: Leadership | None = None
        self._schemas: dict[int, dict[str, tuple[int, ...]]] = {}

    def still_leading(self) -> bool:
        """Whether this process still holds the merger lock (always, without one: SQLite, tests)."""
        return self.leadership is None or self.leadership.still_held()

    def get(self, run_id: int) -> RunRuntime | None:
        return self.runtimes.get(run_id)

    def put(self, rt: RunRuntime) -> None:
        with self._lock:
            self.runtimes[rt.run_id] = rt

    def remove(self, run_id: int) -> None:
        """Forget one run's live model (it finished, or was deleted)."""
        with self._lock:
            rt = self.runtimes.pop(run_id, None)
            self._schemas.pop(run_id, None)
        if rt is not None:
            rt.removed = True

    def runtime_list(self) -> list[RunRuntime]:
        with self._lock:
            return list(self.runtimes.values())

    def drop(self) -> None:
        """Forget every live model (this process stopped leading)."""
        with self._lock:
            self.runtimes.clear()

    def schema_of(self, run_id: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape of a run's tensors, in any process: what decoding a delta needs (no weights)."""
        rt = self.runtimes.get(run_id)
        if rt is not None:
            return rt.schema
        if run_id not in self._schemas:
            with self.db.read() as c:
                run = run_rows.by_id(c, run_id)
            if run is None:
                raise NotFound(f"no run {run_id}")
            cfg = RunConfig.model_validate_json(run.config_json)
            # shapes only (the meta device): nothing allocated, nothing initialised; either arch
            self._schemas[run_id] = meta_schema(cfg.model)
        return self._schemas[run_id]

    def warm_up(self) -> None:
        """Do before the first requests what they would otherwise wait for: torch's first model build
        in a process (even on the meta device), each run's schema, which every upload is checked
        against, and the compiled kernels that checking and merging use (shared/kernels.py)."""
        kernels.ready()  # compiles (or loads from numba's cache) the kernels now
        with self.db.read() as c:
            run_ids = run_rows.created_ids(c)
        for run_id in run_ids:
            self.schema_of(run_id)
        if not run_ids:  # a run created later finds torch initialised
            meta_schema(ModelConfig())
