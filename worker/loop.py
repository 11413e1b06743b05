"""The worker's main loop: lease -> snapshot -> shard -> train (exchanging, for sparta) -> push,
until told to stop.

Ctrl-C once: finish the current lease, deliver it, exit. Twice: exit at once.

Churn: the trainer's state is saved under state_dir/runs/ (worker/state.py) every
checkpoint_every_steps local steps and at each round's end, and a finished round's delta is saved
before its upload and forgotten once the coordinator has answered it. A restarted worker first
delivers those deltas (the coordinator answers the same bytes the same way), then finishes the
round it was in, and only then asks for a new lease (asking gives the previous lease up). A
coordinator that is down or restarting is waited for, with backoff and jitter, at start and
between rounds; what was trained meanwhile waits on disk.

Overlap (settings.overlap, on by default): a round's delta is uploaded on a background thread
(one upload at a time: a round that ends while the previous upload still runs waits for it) and
the trainer's end-of-round state is written on another, while the worker moves on. The upload
thread only sends and forgets the file; the loop settles its answer between rounds, on the
training thread: an acknowledgement counts the round, a refusal puts the delta's content back into
the trainer's residual. Asking for a lease gives up the worker's earlier leases except the one the
request names (`?keep=`); with a coordinator that says so in /healthz (`lease_ahead`), the next
lease, its model update and its shard are fetched on a background thread near the end of a round
(diloco), keeping the lease still training, so the next round starts at once while the upload runs.
Without it, the next lease is asked for once the upload was answered. Either way a round's base
version cannot include the worker's own delta still uploading: leasing ahead, every delta is one
version staler than in sequence.

Manners: before each round and between local steps the governor (worker/governor.py) asks the
policy (worker/policy.py) whether to train now: `idletrain worker pause`, the daily transfer cap,
battery, and with --when idle the user's presence or the CPU load. A pause mid-round saves the
round first, waits in place for a while, then lets the lease go and resumes the saved round when
training may go on (policy.hold_limit_s says why). The status file and the display
(worker/control.py, worker/progress.py) follow it all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import signal
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import torch

from shared import codec, protocol
from shared.algorithms import sync
from shared.algorithms.compress import delta_to_tensors
from shared.errors import DeltaFormatError, SnapshotError
from shared.model import ModelConfig, meta_schema
from shared.snapshot import decode_snapshot, version_zero
from worker import memory
from worker.client import (
    CoordinatorClient,
    CoordinatorError,
    IntegrityError,
    InvalidAnswer,
    backoff_delay,
    invalid_answer,
    is_transient,
)
from worker.control import ControlFile, StatusFile, WorkerStatus
from worker.governor import Governor
from worker.host import HostMonitor, HostReaders, system_readers
from worker.lease_keeper import LeaseKeeper
from worker.progress import Display, Progress, make_display
from worker.settings import WorkerSettings
from worker.state import RoundState, StateStore, TrainerState
from worker.throttle import DailyTransfer
from worker.trainer import ExchangeFn, LocalTrainer, RoundResult, RoundSuspended, pick_device

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


_SHA256 = re.compile(protocol.SHA256_PATTERN)


class ShardCache:
    """Shards on disk by content hash: a shard is downloaded once per machine.

    The hash comes from the coordinator, which is not trusted: a file name is made only of a
    64-character lowercase hex digest (anything else is refused before any path is built), the
    path must stay under the cache's folder, and a hit is hashed again before use (a file that
    rotted or was replaced is deleted and the shard fetched anew, never trained on)."""

    def __init__(self, root: Path, max_files: int = 256) -> None:
        self.root = root / "shards"
        self.max_files = max_files

    def path(self, sha: str) -> Path:
        """The file of shard `sha`; ValueError when `sha` is not a digest (an absolute path, '../x')."""
        if not isinstance(sha, str) or _SHA256.fullmatch(sha) is None:
            raise ValueError(f"shard hash {str(sha)[:80]!r} is not 64 lowercase hex characters")
        path = self.root / f"{sha}.bin"
        if path.parent.resolve() != self.root.resolve():  # a symlinked file name cannot be made of hex
            raise ValueError(f"shard file {path} is outside the cache {self.root}")
        return path

    def get(self, sha: str) -> bytes | None:
        path = self.path(sha)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        if hashlib.sha256(raw).hexdigest() != sha:
            log.warning("cached shard %s fails its SHA-256 (corrupted or replaced); deleting it and fetching "
                        "it again", path.name)
            path.unlink(missing_ok=True)
            return None
        return raw

    def put(self, sha: str, raw: bytes) -> None:
        path = self.path(sha)
        self.root.mkdir(parents=True, exist_ok=True)
        files = sorted(self.root.glob("*.bin"), key=lambda p: p.stat().st_mtime)
        for old in files[: max(0, len(files) - self.max_files + 1)]:
            old.unlink(missing_ok=True)
        tmp = self.root / f".{sha}.tmp"
        tmp.write_bytes(raw)
        os.replace(tmp, path)


class _Upload:
    """One delta's upload on a background thread: `send()` returns the acknowledgement or the
    refusal; anything it raises (a transient failure, a kill in a test) is kept for the settling."""

    def __init__(self, lease: protocol.Lease, result: RoundResult, send) -> None:
        self.lease, self.result = lease, result
        self.outcome: protocol.DeltaAccepted | CoordinatorError | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(send,), daemon=True,
                                        name=f"idletrain-upload-{lease.lease_id}")
        self._thread.start()

    def _run(self, send) -> None:
        try:
            self.outcome = send()
        except BaseException as exc:  # noqa: BLE001 -- handed to the training thread, which re-raises it
            self.error = exc
        finally:
            self.done.set()


@dataclasses.dataclass
class _Own:
    """A delta this worker sent (or is sending): its version once acknowledged."""

    lease_id: int
    body: bytes
    seq: int | None = None
    sent: dict[str, torch.Tensor] | None = None  # its dense form, kept for the newest one only (memory)


@dataclasses.dataclass
class _Prefetch:
    """The next lease, its base model and its shard, fetched on a background thread near the end of
    the round before (lease_ahead): `lease` is None when there was no work or the fetch failed."""

    done: threading.Event
    lease: protocol.Lease | None = None
    base: dict[str, torch.Tensor] | None = None
    tokens: torch.Tensor | None = None
    seconds: float = 0.0


LEASE_LOST = (404, 409, 410)  # the lease is gone, delivered otherwise, or too stale: take a new one
# A delta saved before a restart is also dropped on answers that will never change for those bytes.
REDELIVERY_REFUSED = (400, 403, 404, 409, 410, 413, 422)


def _why(exc: BaseException) -> str:
    if isinstance(exc, CoordinatorError):
        return f"HTTP {exc.status}: {exc.detail}"
    return repr(exc)


class Worker:
    def __init__(self, settings: WorkerSettings, *, stop: StopFlag | None = None,
                 client: CoordinatorClient | None = None, host: HostReaders | None = None,
                 display: Display | None = None) -> None:
        """`host` reads the machine (idle time, battery, load; default: this machine's probes) and
        `display` shows progress (default: a live panel on a terminal, log lines elsewhere)."""
        self.settings = settings
        self.stop = stop or StopFlag()
        self.tokens = TokenStore(settings.state_dir)
        self.shards = ShardCache(settings.state_dir / "cache")
        self.store = StateStore(settings.state_dir, settings.coordinator, settings.run)
        self.device = pick_device(settings.device)
        # The largest model this worker trains: --max-params, else what this machine's memory holds now.
        self.max_params = settings.max_params or memory.default_max_params(memory.probe(self.device))
        if settings.max_params is None:
            log.info("training models of up to %s parameters (from this machine's available memory; "
                     "--max-params sets another limit)", f"{self.max_params:,}")
        # Every answer is capped while it streams at the largest snapshot (or shard) that limit allows.
        self.client = client or CoordinatorClient(settings.coordinator, timeout_s=settings.request_timeout_s,
                                                  max_retries=settings.max_retries,
                                                  max_download_bytes=memory.download_cap_bytes(self.max_params))
        self.trainer = LocalTrainer(self.device)
        self._snapshot: tuple[int, dict[str, torch.Tensor]] | None = None  # (version, params)
        self._hops = 0  # incremental updates applied since the last full snapshot
        self.join_bytes: int | None = None  # what the first base cost to download (0: version 0 built here)
        self._registered = False
        self.rounds = 0
        self.suspended = False  # the last round was set aside while paused (RoundSuspended)
        self._inflight: _Upload | None = None  # the delta uploading in the background (settings.overlap)
        # Ask for the next lease while a delta still uploads: only of a coordinator that keeps that
        # lease (None: as its /healthz says, `keeps_delivering_lease`; older coordinators do not say it).
        self.lease_ahead: bool | None = None
        self._prefetch: _Prefetch | None = None  # the next lease, fetched during the end of a round
        self._prefetch_s = 1.0  # how long the last prefetch took: when to start the next one
        self._saver: threading.Thread | None = None  # the end-of-round state on its way to disk (overlap)
        # this worker's recent deltas (diloco) that a new lease's base may not hold yet: see _ahead_of
        self._own: list[_Own] = []
        # manners, progress, the control channel
        rules = settings.rules()
        self.transfer = DailyTransfer(settings.state_dir / "transfer.json", cap_bytes=rules.daily_transfer_bytes)
        self._moved_bytes = 0  # this process, all traffic: the daily cap's estimate of a round
        self.progress = Progress()
        self.display = display if display is not None else make_display()
        self.status_file = StatusFile(self.store.dir)
        self._publish_lock = threading.Lock()
        self._started_at = datetime.now(UTC).isoformat(timespec="seconds")
        monitor = None
        if rules.when == "idle" or rules.on_battery == "pause":
            monitor = HostMonitor(rules, host if host is not None else system_readers())
        self.governor = Governor(rules, control=ControlFile(self.store.dir), transfer=self.transfer,
                                 monitor=monitor, check_every_s=settings.check_every_s, publish=self.publish,
                                 on_resume=self.progress.restart_clock)

    # -- progress and status --------------------------------------------------------------------

    def _moved(self, n: int) -> None:
        self._moved_bytes += n
        self.transfer.add(n)

    def status(self) -> WorkerStatus:
        """What status.json and the display show, now."""
        p, paused = self.progress, self.governor.paused
        lease = p.lease
        state = p.phase if p.phase == "stopped" or paused is None else "paused"
        nxt = p.next_sync() if lease is not None and paused is None else None
        return WorkerStatus(
            pid=os.getpid(), coordinator=self.settings.coordinator, run=self.settings.run, state=state,
            reason=paused.reason if state == "paused" else p.wait_reason,
            pause_kind=paused.kind if state == "paused" else "", device=self.device.type,
            lease=lease.lease_id if lease is not None else None, step=p.step if lease is not None else 0,
            steps=p.steps if lease is not None else 0, loss=p.loss if lease is not None else None,
            tokens_per_s=p.tokens_per_s() if lease is not None and state == "training" else None,
            next_sync_in_s=nxt[1] if nxt is not None else None, rounds=self.rounds,
            bytes_sent=self.client.sent_bytes, bytes_received=self.client.received_bytes,
            transfer_today_bytes=self.transfer.used_today(), transfer_cap_bytes=self.transfer.cap_bytes,
            paused_since=(self.governor.paused_since.isoformat(timespec="seconds")
                          if state == "paused" and self.governor.paused_since else None),
            started_at=self._started_at)

    def publish(self) -> None:
        """Write status.json and move the display on (the governor's thread calls this every few
        seconds, the training thread at each change)."""
        with self._publish_lock:
            if self.store.dir.is_dir():
                self.status_file.write(self.status())
            self.display.tick()

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
        """The lease's base model: the copy held, the change since it (an int8 update, a fraction
        of the bytes), or the full snapshot (first time, after MAX_HOPS updates, or when the
        coordinator no longer keeps the version held). Version 0, the first time, is built from the
        run's seed and only its hash is checked (a 304, no body) when the coordinator says the seed."""
        held = self._snapshot
        if held is not None and held[0] == lease.base_version:
            return held[1]
        schema = meta_schema(ModelConfig.from_dict(lease.model))  # shapes only: nothing allocated
        if held is not None and held[0] < lease.base_version and self._hops < sync.MAX_HOPS:
            try:
                blob = self.client.model_update(lease.run, held[0], lease.base_version)
                update = codec.decode(blob, schema=schema)
                if update.base_version != held[0]:
                    raise DeltaFormatError(f"update starts at version {update.base_version}, not {held[0]}")
                params = {n: t.clone() for n, t in held[1].items()}
                sync.apply_update(params, update)
                self._snapshot, self._hops = (lease.base_version, params), self._hops + 1
                return params
            except CoordinatorError as exc:
                if exc.status not in (404, 410, 422):
                    raise
                log.info("no update %d -> %d (%s); downloading the snapshot", held[0], lease.base_version,
                         _why(exc))
            except (DeltaFormatError, IntegrityError) as exc:
                log.warning("update %d -> %d unusable (%s); downloading the snapshot", held[0], lease.base_version,
                            exc)
        made = None  # version 0 made here from the run's seed: only its hash is checked, nothing downloaded
        if held is None and lease.base_version == 0 and lease.init_seed is not None:
            made = version_zero(lease.run, lease.model, lease.init_seed)
        blob, version = self.client.snapshot(lease.run, lease.base_version, if_sha256=made[1] if made else None)
        if blob is None:
            params = made[0]
        else:
            if made is not None:
                log.info("version 0 built from the run's seed differs from the coordinator's; downloaded it")
            params, _ = decode_snapshot(blob, schema=schema)
        self._snapshot, self._hops = (version, params), 0
        if self.join_bytes is None:
            self.join_bytes = 0 if blob is None else len(blob)
        return params

    SHARD_TRIES = 3  # downloads of a shard that fails its hash or its zstd before the lease is given up

    def _tokens(self, lease: protocol.Lease) -> torch.Tensor:
        """The lease's shard: the cached copy (hashed again), else downloaded and checked. A download
        that fails its hash or does not decompress is fetched again with backoff, SHARD_TRIES times
        in all; then IntegrityError (the round gives the lease up). The first Ctrl-C ends a wait."""
        try:
            raw = self.shards.get(lease.shard_sha256)
        except ValueError as exc:  # not a digest: never made into a path
            raise InvalidAnswer(f"lease {lease.lease_id}: {exc}") from None
        attempt = 0
        while raw is None:
            try:
                raw = self.client.shard(lease.run, lease.shard_id, expected_sha256=lease.shard_sha256)
            except IntegrityError as exc:
                attempt += 1
                if attempt >= self.SHARD_TRIES or self.stop.event.is_set():
                    raise IntegrityError(f"shard {lease.shard_id} failed {attempt} downloads ({exc})") from None
                delay = backoff_delay(attempt)
                log.warning("lease %d: %s; fetching it again in %.1f s (%d/%d)", lease.lease_id, exc, delay,
                            attempt + 1, self.SHARD_TRIES)
                self.stop.event.wait(delay)
                continue
            self.shards.put(lease.shard_sha256, raw)
        return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())

    def _exchange_for(self, lease_id: int) -> ExchangeFn:
        """The trainer's exchange callable for one lease (sparta): (step, body) -> correction bytes."""
        def exchange(step: int, body: bytes) -> bytes:
            return self.client.exchange(lease_id, step, body)

        return exchange

    # -- waiting --------------------------------------------------------------------------------

    def _wait(self, attempt: int, exc: BaseException) -> None:
        """Back off after a transient failure (as long as the coordinator's Retry-After said, when
        it said). The first Ctrl-C ends the wait."""
        hint = getattr(exc, "retry_after", None)
        delay = hint if hint is not None else backoff_delay(attempt)
        log.warning("coordinator %s unreachable (%s), retrying in %.1fs", self.settings.coordinator, _why(exc), delay)
        self.stop.event.wait(delay)

    def wait_for_coordinator(self) -> protocol.Health | None:
        """/healthz, asked until it answers; None when stopped while waiting."""
        attempt = 0
        while not self.stop.event.is_set():
            try:
                return self.client.health(max_retries=0)
            except (httpx.TransportError, CoordinatorError) as exc:
                if not is_transient(exc):
                    raise
                self._wait(attempt, exc)
                attempt += 1
        return None

    # -- local state ----------------------------------------------------------------------------

    def _save(self, state: TrainerState) -> None:
        self._join_saver()  # in order: an earlier state written in the background goes first
        self._write(state)

    def _write(self, state: TrainerState) -> None:
        try:
            self.store.save(state)
        except OSError as exc:  # a full disk costs the resume, not the round
            log.warning("cannot save the local training state to %s (%s); going on without", self.store.dir, exc)

    def _save_trainer(self) -> None:
        """The trainer's state between rounds. With overlap it is written on a background thread (the
        copy is taken here, so the next round's training does not change it); every later save and
        every read of the state on disk waits for it first."""
        if not self.trainer.has_state():
            return
        state = self.trainer.export_state()
        if not self.settings.overlap:
            self._save(state)
            return
        self._join_saver()
        self._saver = threading.Thread(target=self._write, args=(state,), name="idletrain-save", daemon=True)
        self._saver.start()

    def _join_saver(self) -> None:
        saver, self._saver = self._saver, None
        if saver is not None:
            saver.join()

    def _save_unsent(self, lease: protocol.Lease, body: bytes) -> None:
        try:
            self.store.save_unsent(lease, body)
        except OSError as exc:
            log.warning("cannot save lease %d's delta to %s (%s); uploading it anyway",
                        lease.lease_id, self.store.dir, exc)

    def _forget_unsent(self, lease_id: int) -> None:
        try:
            self.store.clear_unsent(lease_id)
        except OSError as exc:
            log.warning("cannot remove lease %d's delta from %s (%s)", lease_id, self.store.dir, exc)

    def _restore(self) -> None:
        """At start: the trainer as it was between rounds (AdamW state, residual, sparta replica).
        A round in flight is left to _recover(), which resumes it."""
        saved = self.store.load()
        if saved is None:
            return
        unsent = {u.lease.lease_id for u in self.store.load_all_unsent()}
        if saved.round is not None and saved.round.lease.lease_id in unsent:
            # The round ended and its delta was saved, then the worker died before the end-of-round
            # state: the residual on disk is from before the round and would send again what the
            # delta carries, and the round must not be trained twice. Keep the rest.
            log.info("lease %d ended before the restart; its delta is delivered next", saved.round.lease.lease_id)
            saved.round, saved.residual = None, {}
            fixed = True
        elif saved.round is not None:
            return
        else:
            fixed = False
        try:
            self.trainer.restore_state(saved)
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            log.warning("local training state in %s does not fit (%s); starting afresh", self.store.dir, exc)
            self.store.clear()
            return
        if fixed:
            self._save_trainer()
        log.info("restored the local training state (%d local steps so far)", self.trainer.steps_done)

    def _recover(self) -> None:
        """Before asking for a lease (which gives up the previous one): settle the upload in flight,
        deliver the deltas saved before a restart or an outage, then finish the round that was
        interrupted."""
        self._join_saver()
        saved = self.store.load()
        rnd = saved.round if saved is not None else None
        if rnd is not None:
            # restore first: a refused delta's content goes back into the residual the round resumes with
            try:
                self.trainer.restore_state(saved)
            except (ValueError, TypeError, KeyError, RuntimeError) as exc:
                log.warning("lease %d: the saved round does not fit (%s); dropping it", rnd.lease.lease_id, exc)
                self.store.clear()
                rnd = None
        self._settle_upload()
        for unsent in self.store.load_all_unsent():
            lease = unsent.lease
            log.info("lease %d: delivering its delta saved before the interruption (%.1f KB)",
                     lease.lease_id, len(unsent.body) / 1024)
            ack = self._deliver(lease, unsent.body, redelivery=True)
            if ack is not None:
                if lease.algorithm == "diloco" and all(o.lease_id != lease.lease_id for o in self._own):
                    self._own.append(_Own(lease.lease_id, unsent.body))  # saved before a restart
                self._own_acked(lease.lease_id, ack)
                self._acked()
                log.info("lease %d: delivered -> v%d%s", lease.lease_id, ack.will_merge_into,
                         " (it had arrived before)" if ack.duplicate else "")
        if rnd is None:
            return
        log.info("resuming lease %d at step %d/%d", rnd.lease.lease_id, rnd.step, rnd.lease.inner.steps)
        self._round(rnd.lease, resume=rnd)

    # -- rounds ---------------------------------------------------------------------------------

    def _acked(self) -> None:
        self.rounds += 1
        self.progress.utilisation.acked()

    def _deliver(self, lease: protocol.Lease, body: bytes, *,
                 redelivery: bool = False) -> protocol.DeltaAccepted | None:
        """Upload a saved delta; forget it once answered. None when refused for good (its content
        goes back to the residual); transient failures raise and leave it on disk."""
        try:
            ack = self.client.upload_delta(lease.lease_id, body)
        except CoordinatorError as exc:
            if exc.status not in (REDELIVERY_REFUSED if redelivery else LEASE_LOST):
                raise
            log.warning("lease %d: delta refused (%s); taking a new lease", lease.lease_id, _why(exc))
            self._forget_unsent(lease.lease_id)  # first: a crash now loses this delta's content, never counts it twice
            self._take_back(lease, body)
            return None
        self._forget_unsent(lease.lease_id)
        return ack

    def _take_back(self, lease: protocol.Lease, body: bytes) -> None:
        """A refused delta's content goes back to the residual (on the training thread, between
        rounds: another round may have trained since, so by its bytes), and to disk: into the saved
        round's residual when a round waits there to resume (set aside, or interrupted), else with
        the trainer's state."""
        self._own = [o for o in self._own if o.lease_id != lease.lease_id]  # it will never be merged
        try:
            self.trainer.undeliverable_body(body)
            self._join_saver()
            saved = self.store.load()
            if saved is None or saved.round is None:
                self._save_trainer()
            elif saved.residual:
                schema = {n: tuple(t.shape) for n, t in saved.params.items()}
                for name, sent in delta_to_tensors(codec.decode(body, schema=schema), schema).items():
                    saved.residual[name] += sent
                self._save(saved)
        except (ValueError, KeyError) as err:
            log.warning("lease %d: the refused delta does not fit the model (%s)", lease.lease_id, err)

    # -- own deltas a new base does not hold yet --------------------------------------------------

    OWN_KEEP = 8  # at most this many own deltas are carried into a round's start

    def _own_acked(self, lease_id: int, ack: protocol.DeltaAccepted) -> None:
        for own in self._own:
            if own.lease_id == lease_id:
                own.seq = ack.will_merge_into

    def _ahead_of(self, lease: protocol.Lease, base: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """The sum of this worker's own pseudo-gradients that `lease`'s base does not hold: those
        still uploading or queued (no sequence number yet) and those acknowledged as a version above
        the base. A lease taken while the last delta uploads (lease_ahead), or a base behind the
        merge queue, lacks them; the trainer then starts from base - ahead (train_round) and this
        round does not learn, and send, their progress a second time."""
        self._own = [o for o in self._own if o.seq is None or o.seq > lease.base_version][-self.OWN_KEEP:]
        if lease.algorithm != "diloco" or base is None or not self._own:
            return None
        schema = {n: tuple(t.shape) for n, t in base.items()}
        sents = []
        for own in self._own:
            if own.sent is not None and {n: tuple(t.shape) for n, t in own.sent.items()} == schema:
                sents.append(own.sent)  # the round just trained: no need to decode its bytes again
                continue
            try:
                sents.append(delta_to_tensors(codec.decode(own.body, schema=schema), schema))
            except (DeltaFormatError, ValueError, KeyError):  # another model: not part of this run's progress
                continue
        if len(sents) == 1:
            ahead = sents[0]  # read only (train_round subtracts it into new tensors)
        else:
            ahead = {}
            for sent in sents:
                for name, t in sent.items():
                    ahead[name] = ahead[name] + t if name in ahead else t.clone()
        if ahead:
            log.debug("lease %d: starting from version %d minus %d own delta(s) not merged into it yet",
                      lease.lease_id, lease.base_version, len(self._own))
        return ahead or None

    # -- the upload in the background -----------------------------------------------------------

    def _start_upload(self, lease: protocol.Lease, result: RoundResult) -> None:
        """Upload a saved delta on a background thread. The thread touches only the client and the
        delta's file; _settle_upload() handles the answer on the training thread."""
        def send() -> protocol.DeltaAccepted | CoordinatorError:
            try:
                ack = self.client.upload_delta(lease.lease_id, result.body)
            except CoordinatorError as exc:
                if exc.status not in LEASE_LOST:
                    raise
                self._forget_unsent(lease.lease_id)  # first: a crash now loses its content, never counts it twice
                return exc
            self._forget_unsent(lease.lease_id)
            self.progress.utilisation.acked()  # the time of the acknowledgement, not of its settling
            return ack

        self._inflight = _Upload(lease, result, send)

    def _settle_upload(self) -> None:
        """Wait for the upload in flight (the wait is not compute) and act on its answer: count the
        round, or take a refused delta's content back into the residual. Re-raises its failure (a
        transient one leaves the delta on disk for _recover)."""
        up = self._inflight
        if up is None:
            return
        if not up.done.is_set():
            phase, reason = self.progress.phase, self.progress.wait_reason
            self.progress.set_phase("uploading")
            t0 = self.progress.utilisation.clock()
            up.done.wait()
            self.progress.utilisation.add_upload_wait(self.progress.utilisation.clock() - t0)
            self.progress.set_phase(phase, reason)
        self._inflight = None
        if up.error is not None:
            raise up.error
        outcome = up.outcome
        if isinstance(outcome, CoordinatorError):
            log.warning("lease %d: delta refused (%s); its content goes back to the residual", up.lease.lease_id,
                        _why(outcome))
            self._take_back(up.lease, up.result.body)
            return
        self._own_acked(up.lease.lease_id, outcome)
        self.rounds += 1
        self._log_round(up.lease, up.result, outcome)

    def _may_lease_ahead(self) -> bool:
        return bool(self.lease_ahead)

    # -- the next lease, fetched during the end of a round ----------------------------------------

    def _step_hook(self, lease: protocol.Lease):
        """The trainer's on_step: progress, and (lease_ahead, diloco) the next lease's prefetch once
        the round is about as many steps from its end as the last prefetch took, plus one."""
        def on_step(step: int, loss: float) -> None:
            self.progress.on_step(step, loss)
            if self._prefetch is None and self._should_prefetch(lease, step):
                self._start_prefetch(lease)

        return on_step

    def _should_prefetch(self, lease: protocol.Lease, step: int) -> bool:
        s = self.settings
        if not (s.overlap and self._may_lease_ahead()) or lease.algorithm != "diloco" or self.stop.event.is_set():
            return False
        if self._inflight is not None and not self._inflight.done.is_set():
            return False  # asking now would give up the lease whose delta is still uploading
        if s.max_rounds is not None and self.rounds + (self._inflight is not None) + 1 >= s.max_rounds:
            return False  # this round is the last
        rate = self.progress.steps_per_s()
        left = lease.inner.steps - step
        return rate is not None and left >= 1 and left <= self._prefetch_s * rate + 1

    def _start_prefetch(self, current: protocol.Lease) -> None:
        """Lease (keeping `current`, still training), base model and shard on a background thread. The
        thread touches the client, the shard cache and the held snapshot (which only it changes while
        the round trains); the training thread takes the result between rounds."""
        pre = _Prefetch(done=threading.Event())

        def fetch() -> None:
            t0 = time.perf_counter()
            try:
                lease, _ = self.client.lease(self.settings.run, keep=current.lease_id)
                if lease is not None:
                    self._check_model(lease)
                    pre.base = self._params(lease) if self.trainer.needs_snapshot(lease) else None
                    pre.tokens = self._tokens(lease)
                    pre.lease = lease
            except Exception as exc:  # noqa: BLE001 -- the round end asks again, the usual way
                log.info("fetching the next lease ahead failed (%s); asking after the round", _why(exc))
                pre.lease = None
            finally:
                pre.seconds = time.perf_counter() - t0
                pre.done.set()

        self._prefetch = pre
        threading.Thread(target=fetch, name="idletrain-prefetch", daemon=True).start()

    def _take_prefetch(self) -> _Prefetch | None:
        """The prefetched lease, once fetched (waiting for it is not compute); None if there is none."""
        pre, self._prefetch = self._prefetch, None
        if pre is None:
            return None
        pre.done.wait()
        self._prefetch_s = pre.seconds
        return pre if pre.lease is not None else None

    def _give_up(self, lease: protocol.Lease, exc: BaseException) -> None:
        """A lease whose shard or base model does not arrive intact: hand it back (best effort: it
        expires anyway) so its shard goes to another worker, wait a little, and ask for another."""
        log.warning("lease %d: %s; giving the lease up and asking for another", lease.lease_id, exc)
        try:
            self.client.release(lease.lease_id)
        except (httpx.TransportError, CoordinatorError) as err:
            log.info("lease %d not given back (%s); it expires at its deadline", lease.lease_id, _why(err))
        self.stop.event.wait(backoff_delay(1))  # a coordinator serving bad bytes is not asked again at once

    def _check_model(self, lease: protocol.Lease) -> None:
        """The coordinator is untrusted too. A lease not in the protocol's exact form (ids, hashes,
        names, model config) raises InvalidAnswer: the loop backs off and asks again. A model this
        machine was not set up to hold, sized on the meta device before anything of it exists,
        raises RuntimeError: every lease of the run is the same model, so the worker stops, saying
        which flag raises the limit."""
        try:  # again: a lease may come from disk or a test, not only through the client's parsing
            protocol.Lease.model_validate(lease.model_dump())
        except ValueError as exc:
            raise invalid_answer(f"lease {lease.lease_id!r}", exc) from None
        why = memory.lease_too_big(ModelConfig.from_dict(lease.model), batch_size=lease.inner.batch_size,
                                   max_params=self.max_params)
        if why is not None:
            raise RuntimeError(f"run {lease.run!r}: {why}; not training it")

    def _round(self, lease: protocol.Lease, resume: RoundState | None = None,
               fetched: _Prefetch | None = None) -> None:
        """Train one lease (or the rest of it), save, deliver (settings.overlap: start delivering it in the
        background, once the previous delivery is answered)."""
        self._check_model(lease)
        self.progress.set_phase("downloading")
        try:
            base = None
            if fetched is not None:  # fetched during the end of the round before
                base, tokens = fetched.base, fetched.tokens
            else:
                if resume is None and self.trainer.needs_snapshot(lease):
                    base = self._params(lease)
                tokens = self._tokens(lease)
        except CoordinatorError as exc:
            if exc.status not in LEASE_LOST:
                raise
            log.warning("lease %d: %s", lease.lease_id, _why(exc))
            if resume is not None:  # drop the round; keep what the trainer learnt
                self._save_trainer()
            return
        except (IntegrityError, SnapshotError) as exc:  # bytes that are not what the lease announced
            self._give_up(lease, exc)
            if resume is not None:
                self._save_trainer()
            return
        self.progress.start_round(lease, context=ModelConfig.from_dict(lease.model).context,
                                  step=resume.step if resume is not None else 0)
        self.publish()
        keeper = LeaseKeeper(lease.lease_id, lease.deadline,
                             renew=lambda i, step: self.client.renew(i, step=step).deadline,
                             progress=lambda: self.progress.step)
        ahead = self._ahead_of(lease, base) if resume is None else None
        try:
            with keeper:  # renews the lease while the round moves (a slow machine keeps its shard)
                result = self.trainer.train_round(
                    lease, base, tokens, exchange=self._exchange_for(lease.lease_id), resume=resume,
                    checkpoint=self._save, checkpoint_every=self.settings.checkpoint_every_steps,
                    on_step=self._step_hook(lease),
                    gate=lambda step, save: self.governor.hold(lease, step, save, self.stop.event), ahead=ahead)
        except RoundSuspended as exc:
            log.info("lease %d: round set aside at step %d/%d (saved; it resumes when training may go on)",
                     lease.lease_id, exc.step, lease.inner.steps)
            self.progress.end_round()
            self.suspended = True
            return
        self.progress.utilisation.add_compute(result.seconds)
        if lease.algorithm == "diloco":
            for own in self._own:
                own.sent = None
            self._own.append(_Own(lease.lease_id, result.body, sent=self.trainer.last_sent or None))
        self.progress.set_phase("uploading")
        self._save_unsent(lease, result.body)  # before the trainer's state: see _restore
        self._save_trainer()
        if self.settings.overlap:
            self.progress.end_round()
            self._settle_upload()  # at most one upload in flight: wait for the previous one
            self._start_upload(lease, result)
            return
        try:
            ack = self._deliver(lease, result.body)
        finally:
            self.progress.end_round()
        if ack is None:
            return
        self._own_acked(lease.lease_id, ack)
        self._acked()
        self._log_round(lease, result, ack)

    @staticmethod
    def _log_round(lease: protocol.Lease, result: RoundResult, ack: protocol.DeltaAccepted) -> None:
        exchanged = ""
        if "sparta" in lease.algorithm:
            exchanged = (f", {result.exchanges} exchanges ({result.exchange_bytes_up / 1024:.1f} KB up, "
                         f"{result.exchange_bytes_down / 1024:.1f} KB down, {result.exchanges_failed} failed, "
                         f"{result.exchanges_skipped} skipped)")
        resumed = f" (resumed at step {result.resumed_at})" if result.resumed_at else ""
        log.info("lease %d: shard %d from v%d, %d steps%s, loss %.3f -> %.3f, %.0f tok/s, sent %.1f KB -> v%d%s",
                 lease.lease_id, lease.shard_id, lease.base_version, len(result.losses), resumed, result.losses[0],
                 result.losses[-1], result.tokens / max(result.seconds, 1e-9), len(result.body) / 1024,
                 ack.will_merge_into, exchanged)

    def run(self) -> int:
        """Train until stopped or max_rounds; returns the number of rounds delivered."""
        if not self.store.lock():
            raise RuntimeError(f"another worker process is using {self.store.dir} for run {self.settings.run!r}; "
                               "give each worker on this machine its own --state-dir")
        try:
            self.client.set_transfer(upload_bytes_per_s=self.settings.upload_bytes_per_s(),
                                     download_bytes_per_s=self.settings.download_bytes_per_s(), meter=self._moved)
            self.governor.start()
            self.display.start(self.status)
            try:
                return self._run()
            finally:
                self._join_saver()
                self.progress.set_phase("stopped")
                self.governor.stop()
                self.display.stop()
                self.transfer.flush()
                self.publish()
        finally:
            self.store.unlock()

    def _run(self) -> int:
        s = self.settings
        if s.threads:
            torch.set_num_threads(s.threads)
        health = self.wait_for_coordinator()
        if health is None:
            return self.rounds
        if health.api_version != protocol.API_VERSION:
            raise RuntimeError(f"coordinator speaks API v{health.api_version}, this worker v{protocol.API_VERSION}: "
                               "upgrade idletrain")
        self._restore()
        if self.lease_ahead is None:
            self.lease_ahead = bool(getattr(health, "keeps_delivering_lease", False))
        recover, failures = True, 0
        while not self.stop.event.is_set():
            moved_before = self._moved_bytes
            try:
                if s.max_rounds is not None and self.rounds + (self._inflight is not None) >= s.max_rounds:
                    if self._inflight is None:
                        break
                    self._settle_upload()  # the last round's answer (a refusal means one more round)
                    continue
                if self._inflight is not None and (self._inflight.done.is_set() or not self._may_lease_ahead()
                                                   or not self.governor.check(in_round=False).train):
                    # answered already, asking for a lease would give up the one still uploading, or a
                    # pause comes next (the round counts before it)
                    self._settle_upload()
                    continue
                if not self.governor.wait_between_rounds(self.stop.event):
                    break
                self.progress.set_phase("leasing")
                self.progress.utilisation.start()
                if not self._registered:
                    self.ensure_token()
                    self._registered = True
                if recover:
                    self._recover()
                    recover = False
                else:
                    prefetched = self._take_prefetch()
                    if prefetched is not None:
                        lease, wait_s = prefetched.lease, 0.0
                    elif self._inflight is not None:  # the coordinator keeps the lease still uploading
                        lease, wait_s = self.client.lease(s.run, keep=self._inflight.lease.lease_id)
                    else:
                        lease, wait_s = self.client.lease(s.run)
                    if lease is None:
                        self.progress.set_phase("waiting", f"no work from the coordinator; asking again in "
                                                           f"{wait_s:.0f} s")
                        self.stop.event.wait(wait_s)
                        continue
                    self._round(lease, fetched=prefetched)
                    if not self.suspended:  # what a whole round moved: the daily cap's next estimate
                        self.governor.next_round_bytes = self._moved_bytes - moved_before
                failures = 0
            except (httpx.TransportError, CoordinatorError) as exc:
                if not is_transient(exc):
                    raise
                # The coordinator is down or restarting: wait, then deliver what is on disk first.
                self.progress.set_phase("waiting", f"coordinator unreachable ({_why(exc)})")
                self._wait(failures, exc)
                failures += 1
                recover = True
                continue
            except InvalidAnswer as exc:
                # A lease (or an answer) not in the protocol's form: refused before any of it is used.
                # Asking again gives that lease up; a coordinator that keeps sending such is asked slower.
                delay = backoff_delay(failures)
                log.warning("%s; refused, asking again in %.1f s", exc, delay)
                self.progress.set_phase("waiting", f"refused an invalid answer from the coordinator ({exc})")
                self.stop.event.wait(delay)
                failures += 1
                recover = True
                continue
            if self.suspended:  # paused mid-round and let go: resume that round before any new lease
                self.suspended, recover = False, True
                continue
        self._finish_upload()
        self._release_prefetch()
        self._join_saver()
        self._log_utilisation()
        return self.rounds

    def _release_prefetch(self) -> None:
        """Stopping with a lease fetched ahead and never trained: give it back, so its shard goes back
        to the queue now rather than at the lease's deadline. Best effort: it expires anyway."""
        pre, self._prefetch = self._prefetch, None
        if pre is None or not pre.done.wait(self.settings.request_timeout_s) or pre.lease is None:
            return
        try:
            self.client.release(pre.lease.lease_id)
            log.info("lease %d (fetched ahead, not trained) given back", pre.lease.lease_id)
        except (httpx.TransportError, CoordinatorError) as exc:
            log.info("lease %d (fetched ahead, not trained) not given back (%s); it expires at its deadline",
                     pre.lease.lease_id, _why(exc))

    def _finish_upload(self) -> None:
        """Stopping: settle the upload in flight; a transient failure leaves its delta on disk."""
        up = self._inflight
        if up is None:
            return
        try:
            self._settle_upload()
        except (httpx.TransportError, CoordinatorError) as exc:
            if not is_transient(exc):
                raise
            log.warning("lease %d: delta not delivered (%s); it stays on disk and goes first at the next start",
                        up.lease.lease_id, _why(exc))

    def _log_utilisation(self) -> None:
        u = self.progress.utilisation
        if u.fraction() is not None:
            log.info("computing %.1f%% of %.1f s (first lease to last acknowledgement), %.1f s waiting for uploads",
                     100 * u.fraction(), u.wall_s(), u.upload_wait_s)


def run_worker(settings: WorkerSettings) -> int | None:
    """Run the worker until stopped. Under torchrun (WORLD_SIZE > 1) the processes are one worker:
    rank 0 runs this loop with a trainer that trains each round across every rank, the other ranks
    only follow it and never talk to the coordinator (worker/distributed.py). Returns the rounds
    delivered, or None on a follower rank."""
    from worker import distributed

    session = distributed.from_env(settings.device)  # None: one process, as without torchrun
    if session is not None and not session.leader:
        session.follow(threads=settings.threads)
        return None  # a follower delivers nothing itself: rank 0 counts the rounds
    try:
        stop = StopFlag()
        stop.install()
        worker = Worker(settings, stop=stop)
        if session is not None:
            worker.trainer = distributed.LeadTrainer(session)
        try:
            return worker.run()
        finally:
            worker.trainer.close()
            worker.client.close()
    finally:
        if session is not None:
            session.close()  # tells the other ranks to exit
