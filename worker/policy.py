"""When may the worker train? One pure function over what the host looks like right now.

    decide(rules, conditions) -> Verdict(train, kind, reason)

No I/O and no clock: worker/host.py measures the machine, worker/governor.py asks this module
and makes the worker wait. The first reason that applies wins, in this order:

    user      paused with `idletrain worker pause` (until `idletrain worker resume`)
    cap       between rounds: today's transfer, plus what the next round should move, reaches
              --daily-transfer-mb (until 00:00 UTC). Never inside a round: its snapshot and
              shard are paid for, and a delta held until tomorrow would be stale, so a round
              started under the cap is finished and delivered (a day may overshoot the cap by
              that round's upload and, for sparta, its exchanges)
    hours     outside the --hours windows by the local clock (worker/hours.py): between rounds
              and inside one, like idleness ending
    battery   on battery and --on-battery pause
    active    --when idle and someone used the keyboard or mouse less than --idle-minutes ago
    busy      --when idle, no input idle time to go by, and other processes kept the CPUs busy
              within the last --idle-minutes (the CPU-load fallback)

Readings the host could not give (None) never pause the worker, except that with --when idle a
machine that can tell neither input idle time nor CPU load trains and says so in the verdict's
`note`: refusing forever would make the setting a silent "never".
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Literal

from worker.hours import Hours, allowed, next_start

When = Literal["always", "idle"]
OnBattery = Literal["pause", "run"]

# A round paused mid-way waits in place for at most this share of the time its lease had left
# when the pause began; see hold_limit_s().
HOLD_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class Rules:
    """The volunteer's choices (WorkerSettings), in the units the policy uses."""

    when: When = "always"
    idle_s: float = 300.0  # --idle-minutes
    on_battery: OnBattery = "run"
    max_other_load: float = 0.3  # share of all CPUs other processes may use while the machine counts as idle
    daily_transfer_bytes: int | None = None  # None: no cap
    hours: Hours | None = None  # --hours: when in the week training is allowed (None: any time)
    keep_awake: bool = False  # --keep-awake: hold off the machine's sleep while a round runs (worker/awake.py)


@dataclasses.dataclass(frozen=True)
class Conditions:
    """The host now. None: the probe could not tell (no such sensor, a command missing...)."""

    paused_by_user: bool = False
    user_idle_s: float | None = None  # seconds since the last keyboard or mouse input
    other_load: float | None = None  # share of all CPUs used by other processes, 0..1, latest sample
    load_quiet_s: float | None = None  # seconds since other processes last used more than max_other_load
    on_battery: bool | None = None
    transfer_today_bytes: int = 0  # sent + received since 00:00 UTC (persisted across restarts)
    next_round_bytes: int = 0  # what starting a round would move (the last round's traffic)
    in_round: bool = False  # asked between two local steps of a round, not before a new one
    to_next_day_s: float = 0.0  # until 00:00 UTC, when the daily cap starts afresh
    local_time: datetime | None = None  # the machine's wall clock, for --hours (None: not checked)


@dataclasses.dataclass(frozen=True)
class Verdict:
    train: bool
    kind: str = ""  # "" when training; else user | cap | hours | battery | active | busy
    reason: str = ""  # for people: why not, and what ends it
    note: str = ""  # training, but something worth saying once (an idle test that cannot be made)


def decide(rules: Rules, c: Conditions) -> Verdict:
    if c.paused_by_user:
        return Verdict(False, "user", "`idletrain worker pause` was run (`idletrain worker resume` goes on)")
    cap = rules.daily_transfer_bytes
    if cap is not None and not c.in_round and c.transfer_today_bytes + c.next_round_bytes >= cap:
        need = f", the next round needs ~{_mb(c.next_round_bytes)}" if c.next_round_bytes else ""
        return Verdict(False, "cap", f"daily transfer cap reached ({_mb(c.transfer_today_bytes)} of {_mb(cap)} "
                                     f"today{need}); going on at 00:00 UTC, in {format_duration(c.to_next_day_s)}")
    if rules.hours is not None and c.local_time is not None and not allowed(rules.hours, c.local_time):
        at = next_start(rules.hours, c.local_time)
        day = "" if at.date() == c.local_time.date() else at.strftime("%a ")
        return Verdict(False, "hours", f"outside the training hours ({rules.hours.text}); going on at "
                                       f"{day}{at:%H:%M}")
    if rules.on_battery == "pause" and c.on_battery:
        return Verdict(False, "battery", "on battery power (going on when plugged in; --on-battery run trains "
                                         "anyway)")
    if rules.when == "idle":
        wait = format_duration(rules.idle_s)
        if c.user_idle_s is not None:
            if c.user_idle_s < rules.idle_s:
                return Verdict(False, "active", f"the machine is in use (last input {format_duration(c.user_idle_s)} "
                                                f"ago; training starts after {wait} without input)")
        elif c.load_quiet_s is not None:
            if c.load_quiet_s < rules.idle_s:
                now = f"{c.other_load:.0%} now, " if c.other_load is not None else ""
                ago = format_duration(c.load_quiet_s)
                return Verdict(False, "busy", f"the machine is busy (other processes used more than "
                                              f"{rules.max_other_load:.0%} of the CPUs {ago} ago, {now}training "
                                              f"starts after {wait} below that)")
        else:
            return Verdict(True, note="--when idle, but this machine tells neither input idle time nor CPU load: "
                                      "training as if --when always")
    return Verdict(True)


def hold_limit_s(deadline_in_s: float) -> float:
    """How long a round paused between two local steps waits in place before the worker lets its
    lease go, given the seconds its lease had left when the pause began.

    The choice, kept simple: the pause first checkpoints the round (so a kill loses nothing) and
    waits with everything in memory, for at most half the time the lease had left. Until then a
    short pause (the user glanced at the screen) costs nothing: the round goes on in place and is
    likely still delivered before its deadline. Past it the worker stops holding the lease: the
    round leaves memory (it stays checkpointed on disk), and the coordinator expires the lease at
    its deadline and hands the shard to someone else; the worker never asks it to wait. When
    training may go on, the worker resumes that saved round before anything else and delivers it,
    late if need be: the coordinator still merges a late delta within the run's
    `outer.max_staleness` versions, and answers 410 beyond, in which case what the delta carried
    goes back into the error-feedback residual, so the work reaches the model with the next round.
    Waiting longer in place would rarely save the deadline; giving the round up at once would
    throw away the steps of every brief pause."""
    return max(0.0, HOLD_FRACTION * deadline_in_s)


def next_utc_day(now: datetime) -> datetime:
    """00:00 UTC after `now` (the daily transfer cap's reset)."""
    now = now.astimezone(UTC)
    return datetime(now.year, now.month, now.day, tzinfo=UTC) + timedelta(days=1)


def utc_day(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%d")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def format_duration(seconds: float) -> str:
    """12 s, 4.5 min, 3.2 h: short and readable for a reason or a status line."""
    s = max(0.0, seconds)
    if s < 90:
        return f"{s:.0f} s"
    if s < 90 * 60:
        return f"{s / 60:.1f} min".replace(".0 min", " min")
    return f"{s / 3600:.1f} h".replace(".0 h", " h")
