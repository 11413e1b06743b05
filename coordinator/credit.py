"""Credit for contributors (pure): tokens trained in merged deltas, with a quick-return bonus.

The formula, in the manner of Folding@home's quick-return bonus (QRB):

    credit = tokens × bonus
    bonus  = clamp( sqrt( K × lease_ttl_s / return_s ), 1, MAX_BONUS )

    tokens      the delta's tokens: inner steps × batch size × context of the run's config, what the lease
                allowed (never a number the worker claims; coordinator/services/uploads.py `_round`)
    return_s    seconds from the lease being granted to the delta being received (the round trip:
                snapshot and shard downloads, the local steps, the upload)
    lease_ttl_s the run's lease lifetime, the deadline the worker had (Folding@home's "deadline")
    K = 0.25    a round returned within a quarter of the deadline earns more than its tokens
    MAX_BONUS=4 reached at 1/64 of the deadline; it bounds what a very short round can earn

Only deltas the merger accepts earn credit (a delta rejected at upload or at merge earns none: one
that moves the model by nothing or next to nothing is rejected as `idle` even with screening off;
a clipped one still earns it in full; a sparta round's empty delta earns it for the share of its
exchanges it made, `sparta_tokens`), and it is awarded once, in the merger's transaction that
marks the delta merged (WorkerService.record_merge). A replay spot-check that fails later
(coordinator/spotcheck.py) takes the same amount back (the worker's credit goes down by it, the
check's row records it as credit_revoked); a worker's `tokens_trained` ledger, counted at delivery,
is not revised. Why reward speed: merging is asynchronous, so
a delta that returns quickly lags fewer versions behind the global model and is weighted more
(staleness weight (1+r)^-0.5); a slow round's tokens still count in full, at bonus 1.

Examples with the default 600 s lease: a round back in 150 s or later earns its tokens (bonus
1), in 60 s 1.58x, in 15 s 3.16x, in under 9.4 s 4x.
"""

from __future__ import annotations

import math

K = 0.25
MAX_BONUS = 4.0
FORMULA = f"credit = tokens × clamp(√({K:g} × lease TTL ÷ return time), 1, {MAX_BONUS:g}), for merged deltas only"


def quick_return_bonus(*, return_s: float, lease_ttl_s: float) -> float:
    """The multiplier on a merged delta's tokens: 1 (late or slow) up to MAX_BONUS (very quick)."""
    if lease_ttl_s <= 0:
        raise ValueError(f"lease_ttl_s must be positive, not {lease_ttl_s}")
    if return_s <= 0:  # clocks of one machine; a zero round still gets no more than the cap
        return MAX_BONUS
    return min(MAX_BONUS, max(1.0, math.sqrt(K * lease_ttl_s / return_s)))


def sparta_tokens(tokens: int, *, exchanges_made: int, exchanges_expected: int) -> int:
    """The tokens a sparta round's empty end-of-round delta stands for: its progress travelled only
    through its exchanges, so the round's `tokens` count in the share of the exchanges it made
    (none made: none count; an empty delta alone once earned a whole round's credit)."""
    if exchanges_expected <= 0:
        return 0
    return tokens * min(max(0, exchanges_made), exchanges_expected) // exchanges_expected


def delta_credit(tokens: int, *, return_s: float, lease_ttl_s: float) -> float:
    """Credit for one merged delta of `tokens` tokens, received `return_s` seconds after its lease."""
    if tokens < 0:
        raise ValueError(f"tokens must not be negative, not {tokens}")
    return tokens * quick_return_bonus(return_s=return_s, lease_ttl_s=lease_ttl_s)
