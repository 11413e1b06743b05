"""The worker's main loop: lease -> snapshot -> shard -> train (exchanging, for sparta) -> push,
until told to stop.

Ctrl-C once: finish the current lease, deliver it, exit. Twice: exit at once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path

import numpy as np
import torch

from shared import protocol
from shared.model import ModelConfig, build_model, param_schema
from shared.snapshot import decode_snapshot
from worker.client import CoordinatorClient, CoordinatorError
from worker.settings import WorkerSettings
from worker.trainer import ExchangeFn, LocalTrainer, pick_device

log = logging.getLogger(__name__)


class StopFlag:
    """Set by the first SIGINT/SIGTERM; the second one interrupts at once."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> None:
        def handler(signum, _frame):
            if self.event.is_set():
                raise KeyboardInterrupt
            log.warning("stopping after the current lease (press Ctrl-C again to quit now)")
            self.event.set()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)


class TokenStore:
    """Worker credentials per (coordinator, run), in a 0600 JSON file under the state dir."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "tokens.json"

    def _load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def get(self, coordinator: str, run: str) -> str | None:
        entry = self._load().get(f"{coordinator}|{run}")
        return entry.get("token") if isinstance(entry, dict) else None

    def put(self, coordinator: str, run: str, worker_id: int, token: str) -> None:
        data = self._load()
        data[f"{coordinator}|{run}"] = {"worker_id": worker_id, "token": token}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, self.path)


class ShardCache:
    """Shards on disk by content hash: a shard is downloaded once per machine."""

    def __init__(self, root: Path, max_files: int = 256) -> None:
        self.root = root / "shards"
        self.max_files = max_files

    def get(self, sha: str) -> bytes | None:
        path = self.root / f"{sha}.bin"
        return path.read_bytes() if path.exists() else None

    def put(self, sha: str, raw: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        files = sorted(self.root.glob("*.bin"), key=lambda p: p.stat().st_mtime)
        for old in files[: max(0, len(files) - self.max_files + 1)]:
            old.unlink(missing_ok=True)
        tmp = self.root / f".{sha}.tmp"
        tmp.write_bytes(raw)
        os.replace(tmp, self.root / f"{sha}.bin")


class Worker:
    def __init__(self, settings: WorkerSettings, *, stop: StopFlag | None = None,
                 client: CoordinatorClient | None = None) -> None:
        self.settings = settings
        self.stop = stop or StopFlag()
        self.tokens = TokenStore(settings.state_dir)
        self.shards = ShardCache(settings.state_dir / "cache")
        self.client = client or CoordinatorClient(settings.coordinator, timeout_s=settings.request_timeout_s,
                                                  max_retries=settings.max_retries)
        self.device = pick_device(settings.device)
        self.trainer = LocalTrainer(self.device)
        self._snapshot: tuple[int, dict[str, torch.Tensor]] | None = None  # (version, params)
        self.rounds = 0

    def ensure_token(self) -> None:
        s = self.settings
        token = s.token or self.tokens.get(s.coordinator, s.run)
        if token is None:
            reg = self.client.register(s.run, protocol.RegisterRequest(
                name=s.name, team=s.team, device=self.device.type, join_key=s.join_key))
            self.tokens.put(s.coordinator, s.run, reg.worker_id, reg.token)
            token = reg.token
            log.info("registered with run %s as worker %d", s.run, reg.worker_id)
        self.client.token = token

    def _params(self, lease: protocol.Lease) -> dict[str, torch.Tensor]:
        if self._snapshot is not None and self._snapshot[0] == lease.base_version:
            return self._snapshot[1]
        schema = param_schema(build_model(ModelConfig.from_dict(lease.model)))
        blob, version = self.client.snapshot(lease.run, lease.base_version)
        params, _ = decode_snapshot(blob, schema=schema)
        self._snapshot = (version, params)
        return params

    def _tokens(self, lease: protocol.Lease) -> torch.Tensor:
        raw = self.shards.get(lease.shard_sha256)
        if raw is None:
            raw = self.client.shard(lease.run, lease.shard_id, expected_sha256=lease.shard_sha256)
            self.shards.put(lease.shard_sha256, raw)
        return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())

    def _exchange_for(self, lease_id: int) -> ExchangeFn:
        """The trainer's exchange callable for one lease (sparta): (step, body) -> correction bytes."""
        def exchange(step: int, body: bytes) -> bytes:
            return self.client.exchange(lease_id, step, body)

        return exchange

    def run(self) -> int:
        """Train until stopped or max_rounds; returns the number of rounds delivered."""
        s = self.settings
        if s.threads:
            torch.set_num_threads(s.threads)
        health = self.client.health()
        if health.api_version != protocol.API_VERSION:
            raise RuntimeError(f"coordinator speaks API v{health.api_version}, this worker v{protocol.API_VERSION}: "
                               "upgrade idletrain")
        self.ensure_token()
        while not self.stop.event.is_set():
            lease, wait_s = self.client.lease(s.run)
            if lease is None:
                self.stop.event.wait(wait_s)
                continue
            try:
                base = self._params(lease) if self.trainer.needs_snapshot(lease) else None
                result = self.trainer.train_round(lease, base, self._tokens(lease),
                                                  exchange=self._exchange_for(lease.lease_id))
                ack = self.client.upload_delta(lease.lease_id, result.body)
            except CoordinatorError as exc:
                if exc.status in (404, 409, 410):  # lease lost or too stale: take a new one
                    log.warning("lease %d: %s", lease.lease_id, exc.detail)
                    self.trainer.undeliverable()
                    continue
                raise
            self.rounds += 1
            exchanged = ""
            if "sparta" in lease.algorithm:
                exchanged = (f", {result.exchanges} exchanges ({result.exchange_bytes_up / 1024:.1f} KB up, "
                             f"{result.exchange_bytes_down / 1024:.1f} KB down, {result.exchanges_failed} failed, "
                             f"{result.exchanges_skipped} skipped)")
            log.info("lease %d: shard %d from v%d, %d steps, loss %.3f -> %.3f, %.0f tok/s, sent %.1f KB -> v%d%s",
                     lease.lease_id, lease.shard_id, lease.base_version, len(result.losses), result.losses[0],
                     result.losses[-1], result.tokens / result.seconds, len(result.body) / 1024,
                     ack.will_merge_into, exchanged)
            if s.max_rounds is not None and self.rounds >= s.max_rounds:
                break
        return self.rounds


def run_worker(settings: WorkerSettings) -> int:
    stop = StopFlag()
    stop.install()
    worker = Worker(settings, stop=stop)
    try:
        return worker.run()
    finally:
        worker.trainer.close()
        worker.client.close()
