"""A worker's standing (throttled, banned) and the per-worker rate limits: pure policies."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from coordinator.ratelimit import RateLimiter
from coordinator.trust import THROTTLE_S, judged, rejection_weight, standing, throttle_wait
from shared.config import RobustConfig

CFG = RobustConfig(throttle_after=2, ban_after=4)
M, R = ("merged", None), ("rejected", "too large")


def test_standing_counts_recent_rejections():
    assert standing([M] * 10, current="ok", cfg=CFG).state == "ok"
    assert standing([M, R], current="ok", cfg=CFG).state == "ok"  # one rejection is not a pattern
    s = standing([M, R, M, R], current="ok", cfg=CFG)
    assert s.state == "throttled" and "2 of its last 4" in s.reason and "too large" in s.reason
    assert standing([R, R, R, R], current="throttled", cfg=CFG).state == "banned"
    # old rejections fall out of the window: a throttle lifts itself
    assert standing([R, R] + [M] * 8, current="throttled", cfg=CFG).state == "ok"
    # a ban is sticky
    assert standing([M] * 8, current="banned", cfg=CFG).state == "banned"


def test_a_refusal_for_not_agreeing_with_the_consensus_weighs_half():
    """The direction screen also refuses honest deltas at its margin (bench field's long regime: 23 of
    325): two such refusals in eight no longer throttle a worker; four do, eight ban; other rejections
    and failed spot-checks weigh as before."""
    weak = ("rejected", "does not agree with the consensus: norm 3.1 is 1.0x the workers' median with cosine 0.04")
    spot = ("rejected", "spot-check of lease 9 failed: its direction is not the replay's")
    assert standing([M, weak, M, weak], current="ok", cfg=CFG).state == "ok"
    s = standing([weak, M, weak, weak, M, weak], current="ok", cfg=CFG)
    assert s.state == "throttled" and "weighing 2" in s.reason and "consensus 0.5" in s.reason
    assert standing([weak] * 8, current="throttled", cfg=CFG).state == "banned"
    assert standing([weak, R, M, M], current="ok", cfg=CFG).state == "ok"  # 1.5
    assert standing([weak, R, weak], current="ok", cfg=CFG).state == "throttled"  # 2
    assert standing([spot, spot], current="ok", cfg=CFG).state == "banned"  # 4, as before
    assert rejection_weight([weak, R, spot, M]) == 3.5
    assert rejection_weight([R] * 3 + [M] * 8) == 0  # only the last eight count
    # the pause of a throttled worker grows with the weight, as it did with the count
    now = datetime(2030, 1, 1, tzinfo=timezone.utc)
    assert abs(throttle_wait(rejections=2.5, last_lease_at=now, now=now, cfg=CFG) - THROTTLE_S * 2 ** 0.5) < 1e-3


def test_deltas_that_only_waited_too_long_do_not_count():
    late = ("rejected", "12 versions stale, above the limit of 10", 12)
    rows = [("merged", None, 3), late, ("rejected", "too large", 2), late, ("rejected", "too large", 10)]
    # a screen's rejection counts whatever the staleness; a staleness one does not
    assert judged(rows, max_staleness=10) == [M, R, ("rejected", "too large")]
    assert standing(judged([late] * 8, max_staleness=10), current="ok", cfg=CFG).state == "ok"
    assert standing(judged([late] * 8, max_staleness=20), current="ok", cfg=CFG).state == "banned"


def test_throttle_wait_doubles_per_extra_rejection():
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert throttle_wait(rejections=2, last_lease_at=None, now=now, cfg=CFG) == 0
    assert throttle_wait(rejections=2, last_lease_at=now, now=now, cfg=CFG) == THROTTLE_S
    assert throttle_wait(rejections=3, last_lease_at=now, now=now, cfg=CFG) == 2 * THROTTLE_S
    later = now + timedelta(seconds=THROTTLE_S + 1)
    assert throttle_wait(rejections=2, last_lease_at=now, now=later, cfg=CFG) == 0


def test_token_bucket_burst_then_rate():
    t = [0.0]
    rl = RateLimiter({"lease": (2.0, 3.0), "off": (0.0, 1.0)}, clock=lambda: t[0])
    assert [rl.take("lease", 1) for _ in range(3)] == [0, 0, 0]
    wait = rl.take("lease", 1)
    assert wait == 0.5  # one token every 0.5 s
    assert rl.take("lease", 2) == 0  # buckets are per worker
    t[0] += 0.5
    assert rl.take("lease", 1) == 0
    assert rl.take("lease", 1) > 0
    assert all(rl.take("off", 1) == 0 for _ in range(100))  # rate 0: unlimited
    assert rl.take("unknown", 1) == 0
