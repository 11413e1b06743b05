"""A run's lifecycle (LifecycleService): its options (token budget, epochs, priority), finishing, and
what comes after it.

    active ──budget trained / last epoch done / `run finish`──▶ finishing ──▶ finished ──▶ archived
    paused ──`run finish`──────────────────────────────────────▶ finishing

A finishing run grants no lease (410); the leases out still deliver and their deltas merge. Once
none is out (delivered, expired, or given up at `finish_by`, `run finish --grace`) and every delta
is merged, the merger (Merger's idle loop calls `settle`) evaluates the final model, writes its
snapshot and a checkpoint, exports it as a Hugging Face folder into the run's data dir
(runs/<id>/exports/final/) and marks the run finished. Archiving keeps that (and the evaluations,
the workers' records, the stats) and deletes the bulky state; deleting removes everything.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from datetime import timedelta

from pydantic import ValidationError
from sqlalchemy import Row

from coordinator import checkpoints
from coordinator.db import Database
from coordinator.errors import Conflict, Unprocessable
from coordinator.models import utcnow
from coordinator.queries import leases as lease_rows
from coordinator.queries import runs as run_rows
from coordinator.queries import versions as version_rows
from coordinator.runtime import RunRuntime
from coordinator.services.common import aware, named_run
from coordinator.services.live import LiveRuns
from coordinator.services.recovery import RecoveryService
from coordinator.services.reports import ReportService
from coordinator.storage import Storage
from shared import hf, protocol
from shared.config import RunConfig
from shared.snapshot import snapshot_metadata
from shared.tokenizer import Tokenizer, bytes_tokenizer

log = logging.getLogger(__name__)

FINAL_EXPORT = "exports/final"  # under the run's folder of the data dir


def summary(run: Row) -> protocol.RunSummary:
    return protocol.RunSummary(
        name=run.name, state=run.state, version=run.version, created_at=aware(run.created_at), priority=run.priority,
        token_budget=run.token_budget, tokens_trained=run.tokens_trained, epoch=run.epoch, max_epochs=run.max_epochs,
        n_params=run.n_params, join_key_required=run.join_key_hash is not None,
        finished_at=aware(run.finished_at) if run.finished_at else None)


def finish_reason(c, run: Row) -> str | None:
    """Why an active run is done training (its budget trained, its last epoch's shards all done), or None."""
    if run.token_budget is not None and run.tokens_trained >= run.token_budget:
        return f"its token budget of {run.token_budget:,} tokens is trained"
    if run.max_epochs is not None and run.epoch + 1 >= run.max_epochs:
        states = lease_rows.shard_states(c, run.id)
        if states and set(states) == {"done"}:
            return f"its {run.max_epochs} epoch(s) over the data are trained"
    return None


class LifecycleService:
    def __init__(self, db: Database, storage: Storage, *, live: LiveRuns, recovery: RecoveryService,
                 reports: ReportService) -> None:
        self.db, self.storage, self.live, self.recovery, self.reports = db, storage, live, recovery, reports
        self._finishing: dict[int, threading.Lock] = {}  # run id -> held while its run is finalized
        self._finishing_guard = threading.Lock()

    # -- the operator's -----------------------------------------------------------------------

    def set_options(self, run_name: str, options: protocol.RunOptions) -> protocol.RunSummary:
        """Change a run's budget, epochs or priority (those the request names). The budget and the
        epochs only of a run still training (active or paused)."""
        given = options.model_fields_set
        with self.db.begin() as c:
            run = named_run(run_rows.by_name(c, run_name), run_name)
            if given & {"token_budget", "epochs"} and run.state not in ("active", "paused"):
                raise Conflict(f"run {run_name!r} is {run.state}: its budget and epochs no longer change "
                               "(its priority does); create a new run to train on")
            cfg = RunConfig.model_validate_json(run.config_json)
            changes = {k: getattr(options, k) for k in given}
            if "priority" in changes and changes["priority"] is None:
                raise Unprocessable("priority must be a number")
            try:
                cfg = RunConfig.model_validate({**cfg.model_dump(), **changes})
            except ValidationError as exc:
                raise Unprocessable(f"run {run_name!r}: {exc.errors()[0]['msg']}") from None
            # the epochs follow the config's rule again (RunConfig.max_epochs: its `epochs`, else 1 without a budget)
            max_epochs = cfg.max_epochs() if given & {"epochs", "token_budget"} else run.max_epochs
            run_rows.set_options(c, run.id, config_json=cfg.model_dump_json(), token_budget=cfg.token_budget,
                                 max_epochs=max_epochs, priority=cfg.priority)
            run = run_rows.by_id(c, run.id)
        log.info("run %s: token budget %s, max epochs %s, priority %d", run.name, run.token_budget, run.max_epochs,
                 run.priority)
        return summary(run)

    def finish(self, run_name: str, *, grace_s: float | None = None) -> protocol.RunSummary:
        """Stop granting leases now; the run finishes once the leases out are delivered or expired,
        or at the latest `grace_s` from now (then those still out are given up)."""
        finish_by = utcnow() + timedelta(seconds=grace_s) if grace_s is not None else None
        with self.db.begin() as c:
            run = named_run(run_rows.by_name(c, run_name), run_name)
            if run.state == "finishing" and finish_by is not None:
                run_rows.start_finishing(c, run.id, finish_by=finish_by, states=("finishing",))
            elif not run_rows.start_finishing(c, run.id, finish_by=finish_by):
                if run.state != "finishing":
                    raise Conflict(f"run {run_name!r} is {run.state} already")
            run = run_rows.by_id(c, run.id)
        log.info("run %s: finishing by hand (%s)", run.name,
                 f"leases out given up after {grace_s:.0f} s" if grace_s is not None else "once the leases out are in")
        return summary(run)

    # -- the merger's hook --------------------------------------------------------------------

    def settle(self, rt: RunRuntime) -> bool:
        """The merger, idle: start finishing an active run that is done training, and finish a
        finishing one once no lease is out and every delta is merged. True when it finished."""
        with self.db.read() as c:
            run = run_rows.by_id(c, rt.run_id)
            why = finish_reason(c, run) if run is not None and run.state == "active" else None
        if run is None:
            return False
        if why is not None:
            with self.db.begin() as c:
                if run_rows.start_finishing(c, run.id, finish_by=None, states=("active",)):
                    log.info("run %s: %s; it finishes once the leases out are delivered or expired", run.name, why)
            return False
        if run.state != "finishing":
            return False
        with self.db.begin() as c:  # the leases first: a delivery commits its delta row with its lease's state
            out = run_rows.live_lease_rows(c, run.id)
            if out and run.finish_by is not None and aware(run.finish_by) <= utcnow():
                for lease_id, shard_id in out:
                    lease_rows.end_lease(c, lease_id, shard_id, "expired")
                log.info("run %s: %d lease(s) still out at the end of the grace time given up", run.name, len(out))
                out = []
            next_seq = run_rows.by_id(c, run.id).next_seq
        if out or next_seq - 1 > rt.version:  # leases out, or deltas not merged yet
            return False
        return self.finalize(rt, next_seq=next_seq, wait=False)

    def finalize(self, rt: RunRuntime, *, next_seq: int, wait: bool = True) -> bool:
        """The final evaluation, snapshot, checkpoint and export; then the run is finished and its
        live model let go. False when a late delta was acknowledged meanwhile (`next_seq` moved: an
        expired lease may deliver while its shard is not leased again): the merger merges it, and the
        next settle finishes the run. One thread at a time per run (the merger's settle and an
        operator's archive may both get here): `wait=False` gives up at once when another is at it,
        `wait=True` waits, and finds the run finished when the other thread finished it."""
        with self._finishing_guard:
            lock = self._finishing.setdefault(rt.run_id, threading.Lock())
        if not lock.acquire(blocking=wait):
            return False
        try:
            with self.db.read() as c:
                run = run_rows.by_id(c, rt.run_id)
            if run is None or run.state != "finishing":
                return run is not None and run.state == "finished"
            return self._finalize(rt, next_seq=next_seq)
        finally:
            lock.release()

    def _finalize(self, rt: RunRuntime, *, next_seq: int) -> bool:
        t0 = time.monotonic()
        point = self.reports.evaluate(rt)
        self.recovery.snapshot_newest(rt)
        with rt.lock:
            checkpoints.write(rt)
            params = {n: t.clone() for n, t in rt.outer.views(rt.outer.published_flat(rt.config.outer)).items()}
        self._export(rt, params)
        with self.db.begin() as c:
            if not run_rows.mark_finished(c, rt.run_id, utcnow(), next_seq=next_seq):
                log.info("run %s: a delta came in while it finished; merging it first", rt.config.name)
                return False
        self.live.remove(rt.run_id)
        log.info("run %s finished at version %d: eval loss %s, final export in %s (%.1f s)", rt.config.name,
                 rt.version, f"{point.loss:.4f}" if point else "-", self.final_export(rt.run_id),
                 time.monotonic() - t0)
        return True

    def final_export(self, run_id: int) -> str:
        return f"{self.storage.run_dir(run_id)}/{FINAL_EXPORT}"

    def _export(self, rt: RunRuntime, params: dict) -> None:
        """The final model as a Hugging Face folder, written beside and renamed into place."""
        name = self.final_export(rt.run_id)
        folder = self.storage.blobs.local_path(f"{name}/config.json").parent
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        cfg = rt.config
        tok_name = self.storage.tokenizer(rt.run_id)
        tok = (Tokenizer.from_json(self.storage.read(tok_name).decode(), source=f"run {cfg.name!r}'s tokenizer")
               if self.storage.exists(tok_name) else bytes_tokenizer())
        try:
            hf.write_hf_folder(tmp, cfg.model, params, tok, snapshot_metadata(cfg.name, rt.version,
                                                                             cfg.model.to_dict()))
        except ValueError as exc:  # a model transformers cannot hold: the snapshot and checkpoint still are the model
            log.error("run %s: no Hugging Face export of the final model (%s)", cfg.name, exc)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)

    # -- after it -----------------------------------------------------------------------------

    def archive(self, run_name: str) -> protocol.RunSummary:
        """Keep a finished run's final model, export, evaluations and records; delete its bulky state
        (shards, deltas, model updates, older snapshots and checkpoints). A paused run with no lease
        out is finished first (its final evaluation, checkpoint and export)."""
        with self.db.read() as c:
            run = named_run(run_rows.by_name(c, run_name), run_name)
            out = lease_rows.live_count(c, run.id)
        if run.state == "paused":
            if out:
                raise Conflict(f"run {run_name!r} is paused with {out} lease(s) still out: `idletrain run finish "
                               f"{run_name}` first (it finishes once they are in), then archive it")
            rt = self.recovery.live_model(run.id, run.name)
            if run.next_seq - 1 > rt.version:
                raise Conflict(f"run {run_name!r} has deltas not merged yet; archive it again in a moment")
            with self.db.begin() as c:
                if not run_rows.start_finishing(c, run.id, finish_by=None, states=("paused",)):
                    raise Conflict(f"run {run_name!r} changed state meanwhile; look again (`idletrain run show`)")
            if not self.finalize(rt, next_seq=run.next_seq):
                raise Conflict(f"run {run_name!r} took a late delta while it finished; it is finishing now: "
                               "archive it once it is finished")
        elif run.state != "finished":
            raise Conflict(f"run {run_name!r} is {run.state}: only a finished or paused run is archived "
                           f"(`idletrain run finish {run_name}` first)")
        with self.db.begin() as c:
            run = run_rows.by_id(c, run.id)
            older = version_rows.older_than(c, run.id, run.version)
            version_rows.forget(c, run.id, older)
            run_rows.set_state(c, run.id, "archived")
        files = self._drop_bulk(run.id, final_version=run.version)
        log.info("run %s archived: %d files of its training state deleted; its final model is in %s", run.name,
                 files, self.final_export(run.id))
        with self.db.read() as c:
            return summary(run_rows.by_id(c, run.id))

    def _drop_bulk(self, run_id: int, *, final_version: int) -> int:
        s, keep = self.storage, {self.storage.snapshot(run_id, final_version)}
        keep |= {name for _, name in s.list_checkpoints(run_id)[:1]}
        gone = 0
        for folder in (f"{s.run_dir(run_id)}/shards", s.deltas(run_id), s.updates(run_id), s.copies(run_id),
                       f"{s.run_dir(run_id)}/snapshots", s.checkpoints(run_id)):
            gone += sum(s.delete(name) for name in s.list(folder) if name not in keep)
        return gone

    def delete(self, run_name: str, *, force: bool = False) -> protocol.RunDeleted:
        """Remove the run: its files, then every row of it. An active or finishing run only with `force`."""
        with self.db.read() as c:
            run = named_run(run_rows.by_name(c, run_name), run_name)
        if run.state in ("active", "finishing") and not force:
            raise Conflict(f"run {run_name!r} is {run.state}: workers may be training it; pause or finish it "
                           "first, or delete it anyway with force")
        rt = self.live.get(run.id)
        lock = rt.lock if rt is not None else None
        if lock is not None:
            lock.acquire()  # not in the middle of a merge step
        try:
            self.live.remove(run.id)
            root = self.storage.blobs.root / self.storage.run_dir(run.id)
            doomed = root.with_name(f"{root.name}.deleting-{uuid.uuid4().hex[:8]}")  # an earlier one may be left
            if root.exists():
                root.rename(doomed)  # at once: nothing reads or writes a half-deleted run
            try:
                with self.db.begin() as c:
                    rows = run_rows.delete_run(c, run.id)
            except BaseException:
                if doomed.exists():
                    doomed.rename(root)
                raise
        finally:
            if lock is not None:
                lock.release()
        files = sum(len(names) for _, _, names in os.walk(doomed))
        shutil.rmtree(doomed, ignore_errors=True)
        log.warning("run %s deleted: %d rows, %d files", run.name, sum(rows.values()), files)
        return protocol.RunDeleted(name=run.name, rows=rows, files=files)
