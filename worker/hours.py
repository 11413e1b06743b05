"""Hours-of-day rules (`--hours`): when in the week the worker may train, by the machine's local clock.

    parse_hours("mon-fri 19:00-08:00, sat-sun 00:00-24:00") -> Hours
    allowed(hours, local_time) -> bool
    next_start(hours, local_time) -> the next local time training is allowed (for a reason's "going on at")

Pure: no clock, no I/O (worker/policy.py asks with the governor's reading of the time). The text is
comma-separated windows, each `[DAYS] HH:MM-HH:MM`:

    22:00-07:00                 every night; a window whose end is not after its start runs past
                                midnight into the next day
    mon-fri 19:00-08:00         DAYS: a day (mon) or a range of days (mon-fri, fri-mon); the days
                                are the ones a window *starts* on: this one holds Friday 19:00 to
                                Saturday 08:00, and not Monday 00:00-08:00
    sat-sun 00:00-24:00         24:00 ends a whole day

Training is allowed inside any window. Bad text raises ValueError naming the part that is wrong.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime, timedelta

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # datetime.weekday() order
MINUTES_PER_DAY = 24 * 60
_TIME = re.compile(r"^(\d{1,2}):(\d{2})$")


@dataclasses.dataclass(frozen=True)
class Window:
    days: frozenset[int]  # weekdays (0 = Monday) the window starts on
    start_min: int  # minutes after local midnight, 0..1439
    end_min: int  # 1..1440; at or before start_min: the window ends the next day

    @property
    def length_min(self) -> int:
        return (self.end_min - self.start_min) % MINUTES_PER_DAY or MINUTES_PER_DAY


@dataclasses.dataclass(frozen=True)
class Hours:
    windows: tuple[Window, ...]
    text: str  # as the volunteer wrote it, for messages


def _minutes(text: str, part: str, *, end: bool) -> int:
    m = _TIME.match(text)
    if not m:
        raise ValueError(f"{text!r} in {part!r} is not a time of day (HH:MM, e.g. 07:30)")
    h, mins = int(m.group(1)), int(m.group(2))
    if mins >= 60 or h > 24 or (h == 24 and (mins or not end)):
        raise ValueError(f"{text!r} in {part!r} is not a time of day (00:00 to 23:59; 24:00 only as an end)")
    return h * 60 + mins


def _days(text: str, part: str) -> frozenset[int]:
    names = text.lower().split("-")
    if len(names) > 2 or any(n not in DAYS for n in names):
        raise ValueError(f"{text!r} in {part!r} is not a day or a range of days "
                         f"(one of {', '.join(DAYS)}, or two joined by '-': mon-fri)")
    first, last = DAYS.index(names[0]), DAYS.index(names[-1])
    return frozenset((first + i) % 7 for i in range((last - first) % 7 + 1))


def parse_hours(text: str) -> Hours:
    """The windows `text` names; ValueError saying which part is wrong."""
    windows = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise ValueError(f"an empty window in {text!r} (windows are separated by single commas)")
        words = part.split()
        if len(words) not in (1, 2):
            raise ValueError(f"{part!r} is not a window ([DAYS] HH:MM-HH:MM, e.g. mon-fri 19:00-08:00)")
        days = _days(words[0], part) if len(words) == 2 else frozenset(range(7))
        start, sep, end = words[-1].partition("-")
        if not sep:
            raise ValueError(f"{words[-1]!r} in {part!r} is not a range of times (HH:MM-HH:MM)")
        start_min, end_min = _minutes(start, part, end=False), _minutes(end, part, end=True)
        if start_min == end_min % MINUTES_PER_DAY and end_min != MINUTES_PER_DAY:
            raise ValueError(f"{part!r} starts and ends at the same time (00:00-24:00 is a whole day)")
        windows.append(Window(days, start_min, end_min))
    return Hours(tuple(windows), text.strip())


def _inside(w: Window, t: datetime) -> bool:
    minute = t.hour * 60 + t.minute + t.second / 60
    for back in (0, 1):  # a window that started today, or yesterday and runs past midnight
        if (t.weekday() - back) % 7 in w.days:
            since = minute + back * MINUTES_PER_DAY - w.start_min
            if 0 <= since < w.length_min:
                return True
    return False


def allowed(hours: Hours, local_time: datetime) -> bool:
    """Whether `local_time` (the machine's wall clock) falls inside one of the windows."""
    return any(_inside(w, local_time) for w in hours.windows)


def next_start(hours: Hours, local_time: datetime) -> datetime:
    """The earliest window start after `local_time` (local_time itself when it is allowed)."""
    if allowed(hours, local_time):
        return local_time
    midnight = local_time.replace(hour=0, minute=0, second=0, microsecond=0)
    starts = [midnight + timedelta(days=d, minutes=w.start_min)
              for d in range(8) for w in hours.windows if (local_time.weekday() + d) % 7 in w.days]
    return min(s for s in starts if s > local_time)
