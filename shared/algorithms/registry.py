"""The training algorithms a run can use: one frozen description each, read where a round is
planned, trained, sent and merged (`ALGORITHMS[cfg.algorithm].exchanges`), never a comparison
of names.

    diloco         H local steps from the lease's base, then a compressed pseudo-gradient
                   (base - local) that the coordinator merges with outer Nesterov
    sparta         local steps on a replica the worker keeps, with sparse exchanges with the
                   global model every `sparta.every` steps; the round ends with an empty delta
    sparta+diloco  both: exchanges during the round, a pseudo-gradient at its end

Adding an algorithm touches this file: its name in `AlgorithmName` (the wire's type:
RunConfig.algorithm, Lease.algorithm) and its entry in ALGORITHMS; the two are checked against
each other at import.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Mapping
from typing import Literal, get_args

AlgorithmName = Literal["diloco", "sparta", "sparta+diloco"]
NAMES: tuple[AlgorithmName, ...] = get_args(AlgorithmName)


class Start(enum.Enum):
    """What a round's model starts from."""

    SNAPSHOT = "snapshot"  # the lease's base version (downloaded, cached or built from the run's seed)
    REPLICA = "replica"  # the worker's own replica, kept from round to round (a snapshot only the first time)


class End(enum.Enum):
    """What a round sends when it ends (the delta that closes its lease)."""

    PSEUDO_GRADIENT = "pseudo_gradient"  # base - local, cut down by the lease's compression, merged by the outer rule
    EMPTY = "empty"  # no entries: the round's progress travelled through its exchanges


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: AlgorithmName
    starts_from: Start
    ends_with: End
    exchanges: bool  # sparse exchanges with the global model every `sparta.every` local steps
    # A worker may take its next lease (and fetch its base) before its last delta is merged: it keeps
    # its own unmerged pseudo-gradients and starts the round from base minus those the base lacks
    # (trainer.train_round's `ahead`), so no round learns, and sends, their progress twice.
    leases_ahead: bool


ALGORITHMS: Mapping[AlgorithmName, Algorithm] = types.MappingProxyType({
    "diloco": Algorithm("diloco", Start.SNAPSHOT, End.PSEUDO_GRADIENT, exchanges=False, leases_ahead=True),
    "sparta": Algorithm("sparta", Start.REPLICA, End.EMPTY, exchanges=True, leases_ahead=False),
    "sparta+diloco": Algorithm("sparta+diloco", Start.SNAPSHOT, End.PSEUDO_GRADIENT, exchanges=True,
                               leases_ahead=False),
})


def check_complete(names: tuple[str, ...], table: Mapping[str, Algorithm]) -> None:
    """Raise unless every name has exactly one entry, under its own name, and every entry a name."""
    missing, unnamed = set(names) - set(table), set(table) - set(names)
    wrong = [key for key, algo in table.items() if algo.name != key]
    if missing or unnamed or wrong or len(set(names)) != len(names):
        raise RuntimeError(f"the algorithm registry does not match its names: no entry for {sorted(missing)}, "
                           f"no name for {sorted(unnamed)}, entries under another name: {sorted(wrong)}")


check_complete(NAMES, ALGORITHMS)
