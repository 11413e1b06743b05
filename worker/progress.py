"""What the worker is doing, for people: the live numbers and their display.

    Progress      lease, step/steps, local loss, tokens/s, next sync; updated by the loop and the
                  trainer's step hook, read by the governor's thread (plain attributes: one writer)
    Utilisation   compute time against wall time (Progress.utilisation; `python -m bench utilisation`)
    describe()    one line from a WorkerStatus (plain logs and `idletrain worker status`)
    RichDisplay   on a terminal: a live panel (rich) that the log lines scroll above
    PlainDisplay  elsewhere (systemd, pipes, tests): a log line at each change of state and one every
                  `every_s` seconds while training
"""

from __future__ import annotations

import collections
import logging
import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import Protocol, TextIO

from shared import protocol
from shared.algorithms.registry import ALGORITHMS
from worker.control import WorkerStatus
from worker.policy import Verdict, format_duration

log = logging.getLogger(__name__)

RATE_WINDOW_S = 30.0  # tokens/s is measured over the steps of the last 30 s (pauses excluded)


class Utilisation:
    """Compute time against wall time, from the first lease asked for to the last delta acknowledged.

    compute_s counts the time spent in the trainer's rounds (the local steps, the sparta exchanges'
    bookkeeping and the delta's compression; time paused at the gate left out); everything else (the
    lease, the downloads, the uploads the training did not hide, saving state) is not compute.
    upload_wait_s is the part of that spent waiting for an earlier upload to finish; phase_s is the
    time in each of Progress's phases since the first lease request (where the rest goes). Written by
    the training thread, the acknowledgements by whichever thread delivered them; read by anyone."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.started_at: float | None = None  # the first lease request
        self.last_ack_at: float | None = None
        self.compute_s = 0.0
        self.upload_wait_s = 0.0
        self.rounds = 0  # acknowledged
        self.phase_s: dict[str, float] = {}
        self._phase: tuple[str, float] | None = None

    def start(self) -> None:
        if self.started_at is None:
            self.started_at = self.clock()

    def enter(self, phase: str) -> None:
        """The training thread moves to `phase` (counted once start() was called)."""
        now = self.clock()
        if self._phase is not None:
            name, since = self._phase
            self.phase_s[name] = self.phase_s.get(name, 0.0) + now - since
        self._phase = (phase, now) if self.started_at is not None else None

    def add_compute(self, seconds: float) -> None:
        self.compute_s += max(0.0, seconds)

    def add_upload_wait(self, seconds: float) -> None:
        self.upload_wait_s += max(0.0, seconds)

    def acked(self) -> None:
        self.last_ack_at = self.clock()
        self.rounds += 1

    def wall_s(self) -> float | None:
        if self.started_at is None or self.last_ack_at is None:
            return None
        return max(0.0, self.last_ack_at - self.started_at)

    def fraction(self) -> float | None:
        wall = self.wall_s()
        return self.compute_s / wall if wall else None

    def as_dict(self) -> dict:
        return {"compute_s": self.compute_s, "wall_s": self.wall_s(), "upload_wait_s": self.upload_wait_s,
                "rounds": self.rounds, "utilisation": self.fraction(), "phase_s": dict(self.phase_s)}


class Progress:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.utilisation = Utilisation()
        # starting | leasing | downloading | training | uploading | waiting | blocked | stopped
        self.phase = "starting"
        # while waiting: for work, for the coordinator; while blocked: what is refused and what to do
        self.wait_reason = ""
        self.lease: protocol.Lease | None = None
        self.step = 0
        self.steps = 0
        self.loss: float | None = None
        self._tokens_per_step = 0
        self._exchange_every = 0
        self._marks: collections.deque[tuple[float, int]] = collections.deque(maxlen=256)

    def set_phase(self, phase: str, reason: str = "") -> None:
        self.phase, self.wait_reason = phase, reason
        self.utilisation.enter(phase)

    def start_round(self, lease: protocol.Lease, *, context: int, step: int = 0) -> None:
        self.lease, self.step, self.steps, self.loss = lease, step, lease.inner.steps, None
        self._tokens_per_step = lease.inner.batch_size * context
        self._exchange_every = lease.sparta.every if ALGORITHMS[lease.algorithm].exchanges else 0
        self._marks.clear()
        self._marks.append((self.clock(), step))
        self.phase = "training"
        self.utilisation.enter("training")

    def on_step(self, step: int, loss: float) -> None:
        self.step, self.loss = step, loss
        self._marks.append((self.clock(), step))

    def end_round(self) -> None:
        self.lease = None
        self._marks.clear()

    def restart_clock(self) -> None:
        """After a pause: the time paused is not training time."""
        self._marks.clear()
        self._marks.append((self.clock(), self.step))

    def steps_per_s(self) -> float | None:
        try:
            marks = tuple(self._marks)  # read by the governor's and the display's threads while training appends
        except RuntimeError:
            return None
        if len(marks) < 2:
            return None
        now = marks[-1][0]
        recent = [m for m in marks if now - m[0] <= RATE_WINDOW_S] or marks[-2:]
        first = recent[0] if len(recent) >= 2 else marks[-2]
        dt, ds = now - first[0], marks[-1][1] - first[1]
        return ds / dt if dt > 0 and ds > 0 else None

    def tokens_per_s(self) -> float | None:
        rate = self.steps_per_s()
        return rate * self._tokens_per_step if rate is not None else None

    def next_sync(self) -> tuple[int, float | None] | None:
        """(step, seconds until it) of the next upload: the round's end, or for sparta the next exchange."""
        if self.lease is None or self.steps == 0:
            return None
        target = self.steps
        if self._exchange_every:
            target = min(target, (self.step // self._exchange_every + 1) * self._exchange_every)
        rate = self.steps_per_s()
        return target, ((target - self.step) / rate if rate else None)

    def status(self, paused: Verdict | None, paused_since: datetime | None, **fields) -> WorkerStatus:
        """What status.json and the display show now: these numbers, the governor's pause if any,
        and `fields` (who the worker is, what it counted)."""
        lease = self.lease
        state = self.phase if self.phase == "stopped" or paused is None else "paused"
        nxt = self.next_sync() if lease is not None and paused is None else None
        return WorkerStatus(
            state=state, reason=paused.reason if state == "paused" else self.wait_reason,
            pause_kind=paused.kind if state == "paused" else "",
            lease=lease.lease_id if lease is not None else None, step=self.step if lease is not None else 0,
            steps=self.steps if lease is not None else 0, loss=self.loss if lease is not None else None,
            tokens_per_s=self.tokens_per_s() if lease is not None and state == "training" else None,
            next_sync_in_s=nxt[1] if nxt is not None else None,
            paused_since=paused_since.isoformat(timespec="seconds") if state == "paused" and paused_since else None,
            **fields)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def describe(s: WorkerStatus) -> str:
    """One line: what the worker does, and its numbers."""
    parts = [f"{s.state}" + (f": {s.reason}" if s.reason else "")]
    if s.lease is not None:
        parts.append(f"lease {s.lease} step {s.step}/{s.steps}")
        if s.loss is not None:
            parts.append(f"local loss {s.loss:.3f}")
    if s.tokens_per_s:
        parts.append(f"{s.tokens_per_s:,.0f} tok/s")
    parts.append(f"sent {_mb(s.bytes_sent)}, received {_mb(s.bytes_received)}")
    if s.transfer_cap_bytes:
        parts.append(f"today {_mb(s.transfer_today_bytes)} of {_mb(s.transfer_cap_bytes)}")
    if s.next_sync_in_s is not None and s.state == "training":
        parts.append(f"next sync in ~{format_duration(s.next_sync_in_s)}")
    return " | ".join(parts)


class Display(Protocol):
    def start(self, snapshot: Callable[[], WorkerStatus]) -> None: ...
    def tick(self) -> None: ...
    def stop(self) -> None: ...


class PlainDisplay:
    """Log lines: at each change of state or reason, and every `every_s` while training."""

    def __init__(self, *, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self._snapshot: Callable[[], WorkerStatus] | None = None
        self._last: tuple[str, str] | None = None
        self._at = 0.0

    def start(self, snapshot: Callable[[], WorkerStatus]) -> None:
        self._snapshot = snapshot
        self._at = self.clock()

    def tick(self) -> None:
        if self._snapshot is None:
            return
        s = self._snapshot()
        key = (s.state, s.pause_kind or s.reason)  # a pause's reason text ticks ("3 s ago"): its kind does not
        now = self.clock()
        changed = key != self._last and s.state in ("paused", "training", "waiting")
        if changed or (s.state == "training" and now - self._at >= self.every_s):
            self._last, self._at = key, now
            log.info("%s", describe(s))

    def stop(self) -> None:
        self._snapshot = None


class RichDisplay:
    """A live panel on the terminal (stderr). Log records go through the console so they scroll
    above it instead of tearing it."""

    def __init__(self, stream: TextIO | None = None, *, refresh_per_second: float = 2.0) -> None:
        from rich.console import Console

        self.console = Console(file=stream, stderr=stream is None)
        self.refresh_per_second = refresh_per_second
        self._live = None
        self._moved: list[tuple[logging.StreamHandler, TextIO]] = []

    def start(self, snapshot: Callable[[], WorkerStatus]) -> None:
        from rich.live import Live

        original = sys.stderr
        self._live = Live(get_renderable=lambda: self.render(snapshot()), console=self.console,
                          refresh_per_second=self.refresh_per_second, transient=False, redirect_stderr=True,
                          redirect_stdout=False)
        self._live.start()
        for h in logging.getLogger().handlers:  # basicConfig's handler holds the real stderr: point it at the proxy
            if isinstance(h, logging.StreamHandler) and h.stream is original and sys.stderr is not original:
                self._moved.append((h, original))
                h.setStream(sys.stderr)

    def tick(self) -> None:
        pass  # rich refreshes by itself

    def stop(self) -> None:
        for h, stream in self._moved:
            h.setStream(stream)
        self._moved = []
        if self._live is not None:
            self._live.stop()
            self._live = None

    @staticmethod
    def render(s: WorkerStatus):
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        head = Text(f"idletrain worker · run {s.run} · {s.coordinator} · {s.device} · {s.rounds} rounds delivered",
                    style="bold")
        grid = Table.grid(padding=(0, 2))
        grid.add_column(no_wrap=True)
        grid.add_column()
        if s.state == "paused":
            grid.add_row(Text("⏸ paused", style="yellow bold"), Text(s.reason))
        elif s.state == "blocked":  # refused until someone acts: the reason says what to do
            grid.add_row(Text("■ blocked", style="red bold"), Text(s.reason))
        elif s.reason:
            grid.add_row(Text(f"… {s.state}", style="cyan"), Text(s.reason))
        else:
            grid.add_row(Text(f"▶ {s.state}", style="green bold"), Text(""))
        if s.lease is not None and s.steps:
            bar = Table.grid(padding=(0, 1))
            bar.add_row(Text(f"lease {s.lease}  step {s.step}/{s.steps}"),
                        ProgressBar(total=s.steps, completed=s.step, width=30))
            grid.add_row(Text("round"), bar)
        numbers = []
        if s.loss is not None:
            numbers.append(f"local loss {s.loss:.3f}")
        if s.tokens_per_s:
            numbers.append(f"{s.tokens_per_s:,.0f} tok/s")
        if s.next_sync_in_s is not None and s.state == "training":
            numbers.append(f"next sync in ~{format_duration(s.next_sync_in_s)}")
        if numbers:
            grid.add_row(Text("training"), Text("   ".join(numbers)))
        traffic = f"sent {_mb(s.bytes_sent)}   received {_mb(s.bytes_received)}"
        if s.transfer_cap_bytes:
            traffic += f"   today {_mb(s.transfer_today_bytes)} of {_mb(s.transfer_cap_bytes)}"
        grid.add_row(Text("network"), Text(traffic))
        return Group(head, grid)


def make_display(stream: TextIO | None = None, *, plain_every_s: float = 30.0) -> Display:
    """A live panel when `stream` (stderr) is a terminal, plain log lines otherwise."""
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        try:
            return RichDisplay(stream if stream is not sys.stderr else None)
        except ImportError:  # rich is a dependency, but a trimmed install still gets its lines
            pass
    return PlainDisplay(every_s=plain_every_s)
