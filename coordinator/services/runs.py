"""Runs: create (the operator's), list, config, pause and resume (the lifecycle after: lifecycle.py)."""

from __future__ import annotations

import logging

import numpy as np

from coordinator import checkpoints, corpora, datasets, limits
from coordinator.db import Database
from coordinator.errors import Conflict, Unprocessable
from coordinator.models import utcnow
from coordinator.queries import runs as run_rows
from coordinator.queries import versions as version_rows
from coordinator.runtime import RunRuntime
from coordinator.services.common import hash_secret, named_run
from coordinator.services.lifecycle import summary
from coordinator.services.live import LiveRuns
from coordinator.services.recovery import RecoveryService
from coordinator.settings import CoordinatorSettings
from coordinator.storage import Storage
from shared import protocol
from shared.config import RunConfig
from shared.model import build_model, count_params

log = logging.getLogger(__name__)


class RunService:
    def __init__(self, db: Database, storage: Storage, settings: CoordinatorSettings, *, live: LiveRuns,
                 recovery: RecoveryService) -> None:
        self.db, self.storage, self.settings, self.live, self.recovery = db, storage, settings, live, recovery

    def create(self, cfg: RunConfig) -> protocol.RunCreated:
        """Read the corpus (or the prepared data), cut and store its shards, the eval split and the
        tokenizer, initialise the model (version 0: its snapshot, checkpoint and evaluation), then
        serve the run."""
        allowed = self.settings.allowed_corpus_dirs
        if cfg.data is not None:  # confined before reading a byte of it
            folder = corpora.confine(cfg.data, allowed, what="data")
        else:
            source = corpora.confine(cfg.corpus, allowed)
        with self.db.read() as c:
            if run_rows.id_of(c, cfg.name) is not None:
                raise Conflict(f"a run named {cfg.name!r} exists already; pick another name")
        if (why := limits.undeliverable(cfg, max_upload_bytes=self.settings.max_upload_bytes)) is not None:
            raise Unprocessable(f"run {cfg.name!r} is refused: {why}")
        data = datasets.from_prepared(cfg, folder) if cfg.data is not None else datasets.from_corpus(cfg, source)
        eval_used = min(data.eval.size, cfg.eval_tokens)  # what evaluation reads (RunRuntime.eval_tokens)
        if eval_used < cfg.model.context + 1:
            raise Unprocessable(f"evaluation would read {eval_used} held-out tokens (the data holds out "
                                f"{data.eval.size}, eval_tokens is {cfg.eval_tokens}): fewer than one context "
                                f"of {cfg.model.context} + 1")
        cfg = cfg.model_copy(update={"tokens": data.tokens})  # the coordinator's to say, whatever was sent
        n_params = count_params(build_model(cfg.model, seed=cfg.seed))
        with self.db.begin() as c:
            run_id = run_rows.insert_creating(
                c, name=cfg.name, config_json=cfg.model_dump_json(), n_params=n_params,
                train_tokens=data.train_tokens, eval_tokens=int(data.eval.size),
                join_key_hash=hash_secret(cfg.join_key) if cfg.join_key else None, token_budget=cfg.token_budget,
                max_epochs=cfg.max_epochs(), priority=cfg.priority)
        self.storage.write(self.storage.tokenizer(run_id), data.tokenizer.to_json().encode())
        shard_rows = data.store(self.storage, run_id)
        self.storage.write(self.storage.eval_tokens(run_id), memoryview(np.ascontiguousarray(data.eval)).cast("B"))
        rt = RunRuntime.fresh(run_id=run_id, config=cfg, storage=self.storage)
        self.recovery.calibrate(rt)
        sha, size = rt.write_snapshot()
        checkpoints.write(rt)
        loss = rt.evaluate()
        with self.db.begin() as c:
            run_rows.add_shards(c, shard_rows)
            version_rows.record(c, run_id=run_id, version=0, sha256=sha, size=size)
            version_rows.record_eval(c, run_id=run_id, version=0, loss=loss, tokens_trained=0, at=utcnow())
            run_rows.set_state(c, run_id, "active")
        if self.live.leads:  # otherwise the leader loads it from its checkpoint (RecoveryService.sync_runs)
            self.live.put(rt)
        log.info("run %s created: %d shards (%s tokenizer), %d params, eval loss %.3f", cfg.name, data.n_shards,
                 data.tokens.tokenizer, n_params, loss)
        return protocol.RunCreated(name=cfg.name, n_shards=data.n_shards, n_params=n_params,
                                   train_tokens=data.train_tokens, eval_tokens=int(data.eval.size),
                                   unused_tokens=data.unused_tokens)

    def list(self, state: str | None = None) -> list[protocol.RunSummary]:
        """Every run (or those in `state`): active ones by priority, highest first, then by id."""
        with self.db.read() as c:
            runs = [r for r in run_rows.every(c) if state is None or r.state == state]
        return [summary(r) for r in sorted(runs, key=lambda r: -r.priority)] if state == "active" else [
            summary(r) for r in runs]

    def config(self, name: str) -> RunConfig:
        with self.db.read() as c:
            return RunConfig.model_validate_json(named_run(run_rows.by_name(c, name), name).config_json)

    def set_state(self, run_name: str, state: str) -> protocol.RunSummary:
        """Pause (no new leases; deltas and exchanges of live leases still count) or resume a run."""
        if state not in ("active", "paused"):
            raise Unprocessable(f"a run can be set active or paused, not {state!r}")
        with self.db.begin() as c:
            run = named_run(run_rows.by_name(c, run_name), run_name)
            if run.state not in ("active", "paused"):
                raise Conflict(f"run {run_name!r} is {run.state}: it is no longer paused or resumed")
            run_rows.set_state(c, run.id, state)
            run = run_rows.by_id(c, run.id)
        log.info("run %s is now %s", run.name, state)
        return summary(run)

