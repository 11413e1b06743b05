"""The local control channel: `idletrain worker pause|resume|status` and the running worker talk
through two small JSON files in the worker's per-run state folder (state_dir/runs/<key>/, see
worker/state.py), never through a network port:

    control.json  written by `pause` / `resume`, read by the worker (a stat per local step, so a
                  pause takes effect at the next step boundary): {"format": 1, "paused": bool,
                  "at": ISO time}. It outlives the process: a worker paused and then restarted
                  (or rebooted) stays paused until `resume`; pausing before the worker starts works.
    status.json   written by the worker every few seconds and at each change: what it does, why it
                  waits, its lease, step, loss, tokens/s, bytes moved (WorkerStatus).

Files rather than a Unix socket: nothing listens, both sides survive the other's restart, the
permissions are those of the state folder, and a worker blocked in a long step still takes the
order at its next step. Both are replaced atomically (temp file, rename), never fsynced.

Ctrl-C (or SIGTERM) is the other order: StopFlag, set by the first one (finish the lease, deliver
it, exit); the second one quits at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
from datetime import UTC, datetime
from pathlib import Path

from worker.state import StateStore

log = logging.getLogger(__name__)

FORMAT = 1
CONTROL = "control.json"
STATUS = "status.json"


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class ControlFile:
    """control.json of one run folder. paused() re-reads the file only when it changed (stat)."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / CONTROL
        self._seen: tuple[int, int] | None = None
        self._paused = False

    def paused(self) -> bool:
        try:
            st = self.path.stat()
        except OSError:
            self._seen, self._paused = None, False
            return False
        key = (st.st_mtime_ns, st.st_size)
        if key != self._seen:
            self._seen = key
            data = _read_json(self.path)
            self._paused = bool(data and data.get("paused"))
        return self._paused

    def request(self, *, paused: bool) -> None:
        _write_json(self.path, {"format": FORMAT, "paused": paused, "at": now_iso()})


class StopFlag:
    """Set by the first SIGINT/SIGTERM: the round in flight is saved after the step it is in and the
    worker exits (governor.hold); the second one interrupts at once."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> None:
        def handler(signum, _frame):
            if self.event.is_set():
                log.warning("quitting now; a round in flight resumes from its last checkpoint at the next start")
                raise KeyboardInterrupt
            log.warning("stopping: the round in flight is saved when its current step ends, what is uploading "
                        "is finished, then the worker exits; it resumes there at the next start (press Ctrl-C "
                        "again to quit now)")
            self.event.set()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)


@dataclasses.dataclass
class WorkerStatus:
    """status.json: one running worker, as of updated_at."""

    pid: int
    coordinator: str
    run: str
    state: str  # starting | leasing | downloading | training | uploading | waiting | blocked | paused | stopped
    reason: str = ""  # why paused, waiting or blocked (blocked: refused until someone acts; it says what to do)
    pause_kind: str = ""  # worker/policy.py's Verdict.kind while paused
    device: str = ""
    lease: int | None = None
    step: int = 0
    steps: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    next_sync_in_s: float | None = None  # until the next upload (or sparta exchange), at the current speed
    rounds: int = 0  # delivered by this process
    bytes_sent: int = 0  # by this process
    bytes_received: int = 0
    transfer_today_bytes: int = 0  # this state dir, since 00:00 UTC
    transfer_cap_bytes: int | None = None
    paused_since: str | None = None
    started_at: str = ""
    updated_at: str = ""
    format: int = FORMAT

    @classmethod
    def from_dict(cls, data: dict) -> WorkerStatus:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class StatusFile:
    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / STATUS
        self._lock = threading.Lock()

    def write(self, status: WorkerStatus) -> None:
        status.updated_at = now_iso()
        try:
            with self._lock:
                _write_json(self.path, dataclasses.asdict(status))
        except OSError as exc:  # a status file is worth less than the training it describes
            log.debug("cannot write %s: %s", self.path, exc)

    def read(self) -> WorkerStatus | None:
        data = _read_json(self.path)
        if data is None:
            return None
        try:
            return WorkerStatus.from_dict(data)
        except TypeError:
            return None


# -- the CLI's side ---------------------------------------------------------------------------------

def run_folders(state_dir: Path, *, coordinator: str | None = None, run: str | None = None) -> list[Path]:
    """The per-run folders a pause/resume/status addresses: that of (coordinator, run) when both are
    given (whether a worker ran there yet or not); otherwise every folder under state_dir/runs/
    whose status says a worker ran there, filtered by the one given."""
    if coordinator and run:
        return [StateStore(state_dir, coordinator.rstrip("/"), run).dir]
    found = []
    for folder in sorted((Path(state_dir) / "runs").glob("*")):
        status = StatusFile(folder).read()
        if status is None:
            continue
        if coordinator and status.coordinator != coordinator.rstrip("/"):
            continue
        if run and status.run != run:
            continue
        found.append(folder)
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def is_live(status: WorkerStatus, *, stale_after_s: float = 30.0) -> bool:
    """Whether the process that wrote this status still runs (its pid, and a recent update)."""
    if status.state == "stopped":
        return False
    try:
        age = (datetime.now(UTC) - datetime.fromisoformat(status.updated_at)).total_seconds()
    except ValueError:
        return False
    return age <= stale_after_s and pid_alive(status.pid)
