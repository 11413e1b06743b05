"""Runs: create (the operator's), list, config, pause and resume."""

from __future__ import annotations

import hashlib
import logging

import zstandard

from coordinator import checkpoints, corpora
from coordinator.db import Database
from coordinator.errors import Conflict, Unprocessable
from coordinator.models import utcnow
from coordinator.queries import runs as run_rows
from coordinator.queries import versions as version_rows
from coordinator.runtime import RunRuntime
from coordinator.services.common import aware, hash_secret, named_run
from coordinator.services.live import LiveRuns
from coordinator.services.recovery import RecoveryService
from coordinator.settings import CoordinatorSettings
from coordinator.storage import Storage
from shared import protocol
from shared.config import RunConfig
from shared.data import cut_shards, load_corpus
from shared.model import build_model, count_params

log = logging.getLogger(__name__)


def _summary(run) -> protocol.RunSummary:
    return protocol.RunSummary(name=run.name, state=run.state, version=run.version, created_at=aware(run.created_at))


class RunService:
    def __init__(self, db: Database, storage: Storage, settings: CoordinatorSettings, *, live: LiveRuns,
                 recovery: RecoveryService) -> None:
        self.db, self.storage, self.settings, self.live, self.recovery = db, storage, settings, live, recovery

    def create(self, cfg: RunConfig) -> protocol.RunCreated:
        """Read the corpus, cut and store its shards, initialise the model (version 0: its snapshot,
        checkpoint and evaluation), then serve the run."""
        source = corpora.confine(cfg.corpus, self.settings.allowed_corpus_dirs)  # before reading a byte of it
        with self.db.read() as c:
            if run_rows.id_of(c, cfg.name) is not None:
                raise Conflict(f"a run named {cfg.name!r} exists already; pick another name")
        try:
            corpus = load_corpus(source, max_bytes=cfg.corpus_max_bytes)
            shards = cut_shards(corpus.train, cfg.shard_tokens, shuffle_seed=cfg.seed if cfg.shuffle_shards else None)
        except ValueError as exc:
            raise Unprocessable(str(exc)) from None
        eval_used = min(corpus.eval.size, cfg.eval_tokens)  # what evaluation reads (RunRuntime.eval_tokens)
        if eval_used < cfg.model.context + 1:
            raise Unprocessable(f"evaluation would read {eval_used} held-out bytes (the corpus holds out "
                                f"{corpus.eval.size}, eval_tokens is {cfg.eval_tokens}): fewer than one context "
                                f"of {cfg.model.context} + 1")
        n_params = count_params(build_model(cfg.model, seed=cfg.seed))
        train_tokens = int(sum(x.size for x in shards))
        with self.db.begin() as c:
            run_id = run_rows.insert_creating(
                c, name=cfg.name, config_json=cfg.model_dump_json(), n_params=n_params, train_tokens=train_tokens,
                eval_tokens=int(corpus.eval.size), join_key_hash=hash_secret(cfg.join_key) if cfg.join_key else None)
        cctx = zstandard.ZstdCompressor(level=3)
        shard_rows = []
        for i, tokens in enumerate(shards):
            self.storage.write(self.storage.shard(run_id, i), cctx.compress(tokens.tobytes()))
            shard_rows.append({"run_id": run_id, "index": i, "n_tokens": int(tokens.size),
                               "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()})
        self.storage.write(self.storage.eval_tokens(run_id), corpus.eval.tobytes())
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
        log.info("run %s created: %d shards, %d params, eval loss %.3f", cfg.name, len(shards), n_params, loss)
        return protocol.RunCreated(name=cfg.name, n_shards=len(shards), n_params=n_params,
                                   train_tokens=train_tokens, eval_tokens=int(corpus.eval.size))

    def list(self) -> list[protocol.RunSummary]:
        with self.db.read() as c:
            return [_summary(r) for r in run_rows.every(c)]

    def config(self, name: str) -> RunConfig:
        with self.db.read() as c:
            return RunConfig.model_validate_json(named_run(run_rows.by_name(c, name), name).config_json)

    def set_state(self, run_name: str, state: str) -> protocol.RunSummary:
        """Pause (no new leases; deltas and exchanges of live leases still count) or resume a run."""
        if state not in ("active", "paused"):
            raise Unprocessable(f"a run can be set active or paused, not {state!r}")
        with self.db.begin() as c:
            run = named_run(run_rows.by_name(c, run_name), run_name)
            run_rows.set_state(c, run.id, state)
            run = run_rows.by_id(c, run.id)
        log.info("run %s is now %s", run.name, state)
        return _summary(run)

