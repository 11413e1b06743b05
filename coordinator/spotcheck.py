"""The replay spot-check's policy (pure): which delivered leases are checked, and by which bounds.

A share `rate` of the delivered leases (settings.spot_check_rate) is sampled when the delta is
acknowledged, by a hash of the run's seed and the lease id (the coordinator draws no random numbers
of its own; a worker cannot tell a sampled lease from another, nor make its lease one). The check
itself (coordinator/services/spotchecks.py) re-trains the round on the coordinator's CPU and
compares (shared/algorithms/spotcheck.py); a failed check revokes the delta's credit and counts
against the worker's standing like a rejected delta (coordinator/trust.py).

What it protects first is credit and standing (the robust screens, shared/algorithms/robust.py,
bound what a delta does to the model before it merges); a merged delta whose check fails is also
compensated (coordinator/queries/compensations.py). A sparta round's check compares its exchanges
with a replay of the round from its committed start state.
"""

from __future__ import annotations

import hashlib

from shared.algorithms.registry import ALGORITHMS
from shared.algorithms.spotcheck import CARRIED, CARRIED_COARSE, COARSE_VALUES, EXACT, SpotCheckBounds
from shared.config import RunConfig

MAX_PENDING = 64  # checks waiting per run: beyond, no lease is sampled (each pins a snapshot and a delta copy)


def sampled(*, run_seed: int, lease_id: int, rate: float) -> bool:
    """Whether the lease's delta is checked: a fraction `rate` of the leases (0: none, 1: all)."""
    if rate <= 0:
        return False
    if rate >= 1:
        return True
    digest = hashlib.blake2b(f"spot-check:{run_seed}:{lease_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64 < rate


def bounds(cfg: RunConfig, *, first_lease: bool) -> SpotCheckBounds:
    """A worker's first lease is trained from a fresh AdamW, as the replay is (EXACT); a later one from
    the state its earlier rounds left, which the coordinator does not hold (CARRIED), and at int1/int2
    with error feedback from a residual as large as a round (CARRIED_COARSE)."""
    if first_lease:
        return EXACT
    coarse = cfg.compression.error_feedback and cfg.compression.values in COARSE_VALUES
    return CARRIED_COARSE if coarse else CARRIED


def not_checkable(cfg: RunConfig, *, first_lease: bool, committed: bool = False) -> str | None:
    """Why a run's round cannot be compared with its replay (None: it can). `first_lease`: the round
    starts from a state the replay holds too (a fresh AdamW, or the worker's committed start state);
    `committed`: the worker committed to its round's start state. A round with exchanges (sparta) is
    checked by its exchanges, replayed from the committed state only (its replica's weights, for
    sparta, are the worker's own)."""
    if ALGORITHMS[cfg.algorithm].exchanges:
        if not committed or not replays_from_state(cfg):
            return (f"a {cfg.algorithm} round is replayed from the start state its worker commits to, and this "
                    "one committed none (a worker of an older release)")
        return None
    if cfg.compression.index != "dense" and cfg.compression.error_feedback and not first_lease:
        return ("a sparse delta with error feedback carries values its earlier rounds did not send: only a "
                "worker's first round compares with the replay")
    return None


def replays_from_state(cfg: RunConfig) -> bool:
    """Whether a sampled lease's check asks for the round's committed start state and replays from it.
    Not with update_feedback: the worker's round starts from its own copy of the model, which the
    replay from the base snapshot does not reproduce (an honest int1 round measured cosine 0.91-0.94
    with it, below EXACT): such runs keep the check without a state (CARRIED on later leases)."""
    return not cfg.update_feedback
