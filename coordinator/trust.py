"""A worker's standing, from what robust merging made of its recent deltas (pure).

    rejections among its last RECENT deltas >= ban_after        -> banned   (403 on every request)
    rejections among its last RECENT deltas >= throttle_after   -> throttled: one lease per
        throttle_s * 2^(rejections - throttle_after), answered 429 + Retry-After in between
    otherwise                                                    -> ok

A failed replay spot-check (coordinator/spotcheck.py) counts as SPOT_CHECK_WEIGHT rejections: the
coordinator re-trained that round itself and the delta sent is not it, which says more than a
screen's bound does. One throttles a worker (with the default throttle_after 2), two ban it.

A delta refused for not agreeing with the consensus direction counts as CONSENSUS_WEIGHT (half) a
rejection: that screen also refuses honest deltas at its margin (`bench field`, 8 workers in the long-run
regime: 23 of 325 honest int1 deltas, cosine 0.02-0.05 against its 0.05, which at full weight
throttled all 8 workers to one lease per 30 s within 90 s). Four such refusals among 8 throttle, eight
ban; the deltas themselves stay refused.

A ban is sticky (a later good delta does not lift it; an operator revokes or re-admits); a
throttle lifts itself once good deltas push the rejections out of the window. Only the worker's
own doing counts (`judged`): a delta refused at merge for having waited too long is not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime, timedelta

from shared.algorithms.robust import DISAGREES
from shared.config import RobustConfig

RECENT = 8  # deltas per worker that count
THROTTLE_S = 30.0  # base pause between leases for a throttled worker
SPOT_CHECK = "spot-check"  # how the reason of a failed spot-check's refusal begins
SPOT_CHECK_WEIGHT = 2  # rejections a failed spot-check counts as
CONSENSUS_WEIGHT = 0.5  # what a refusal for not agreeing with the consensus (robust.DISAGREES) counts as


def _weight(reason: str | None) -> float:
    reason = reason or ""
    if reason.startswith(SPOT_CHECK):
        return SPOT_CHECK_WEIGHT
    return CONSENSUS_WEIGHT if reason.startswith(DISAGREES) else 1


@dataclasses.dataclass(frozen=True)
class Standing:
    state: str  # ok | throttled | banned
    reason: str | None


def judged(rows: Sequence[tuple[str, str | None, int | None]], *, max_staleness: int) -> list[tuple[str, str | None]]:
    """(outcome, reason) of the deltas that speak about their worker, from (outcome, reason,
    staleness) rows, order kept. A delta rejected at merge for being more than max_staleness versions
    stale is left out: its upload was within the limit (UploadService.accept refuses it otherwise), so the
    versions it fell behind by were the coordinator's queue, not the worker's doing. Without this, a
    merger falling behind under load would throttle and then ban honest workers."""
    return [(outcome, reason) for outcome, reason, staleness in rows
            if not (outcome == "rejected" and staleness is not None and staleness > max_staleness)]


def rejection_weight(outcomes: Sequence[tuple[str, str | None]]) -> float:
    """What the rejections among the last RECENT outcomes weigh (_weight each)."""
    return sum(_weight(reason) for outcome, reason in list(outcomes)[-RECENT:] if outcome == "rejected")


def standing(outcomes: Sequence[tuple[str, str | None]], *, current: str, cfg: RobustConfig) -> Standing:
    """outcomes: (outcome, reason) of the worker's deltas, oldest first ('merged' / 'rejected')."""
    if current == "banned":
        return Standing("banned", None)  # keep the recorded reason
    recent = list(outcomes)[-RECENT:]
    rejected = [reason for outcome, reason in recent if outcome == "rejected"]
    weight = rejection_weight(recent)
    if not rejected:
        return Standing("ok", None)
    count = f"{len(rejected)} of its last {len(recent)} deltas rejected" + (
        f" (weighing {weight:g}: a failed spot-check weighs {SPOT_CHECK_WEIGHT}, a refusal for not agreeing with "
        f"the consensus {CONSENSUS_WEIGHT:g})" if weight != len(rejected) else "")
    if weight >= cfg.ban_after:
        return Standing("banned", f"{count}; last: {rejected[-1]}")
    if weight >= cfg.throttle_after:
        return Standing("throttled", f"{count}; last: {rejected[-1]}")
    return Standing("ok", None)


def throttle_wait(*, rejections: float, last_lease_at: datetime | None, now: datetime, cfg: RobustConfig) -> float:
    """Seconds a throttled worker must still wait before its next lease (0 = may lease now); `rejections`:
    what its recent rejections weigh (rejection_weight)."""
    if last_lease_at is None:
        return 0.0
    pause = timedelta(seconds=THROTTLE_S * 2 ** max(0, rejections - cfg.throttle_after))
    return max(0.0, (last_lease_at + pause - now).total_seconds())
