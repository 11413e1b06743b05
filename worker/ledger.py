"""The worker's own recent deltas (diloco) that a new lease's base may not hold yet.

A lease taken while the last delta uploads (lease_ahead), or a base behind the coordinator's merge
queue, lacks this worker's latest pseudo-gradients. The round then starts from base - ahead
(LocalTrainer.train_round) so that it does not learn, and send, their progress a second time. The
ledger keeps each delta sent (or being sent) until a base version holds it: its bytes, its version
once acknowledged, and the dense form of the newest one (no need to decode it again).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from shared import codec, protocol
from shared.algorithms.compress import delta_to_tensors
from shared.algorithms.registry import ALGORITHMS
from shared.errors import DeltaFormatError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class OwnDelta:
    """A delta this worker sent (or is sending): its version once acknowledged."""

    lease_id: int
    body: bytes
    seq: int | None = None
    sent: dict[str, torch.Tensor] | None = None  # its dense form, kept for the newest one only (memory)


class OwnDeltas:
    KEEP = 8  # at most this many own deltas are carried into a round's start

    def __init__(self) -> None:
        self.deltas: list[OwnDelta] = []

    def trained(self, lease_id: int, body: bytes, sent: dict[str, torch.Tensor] | None) -> None:
        """A round just trained, its delta about to go (`sent`: its dense form, if the trainer kept it)."""
        for own in self.deltas:
            own.sent = None
        self.deltas.append(OwnDelta(lease_id, body, sent=sent))

    def saved(self, lease_id: int, body: bytes) -> None:
        """A delta saved before a restart, delivered now (known by its bytes only)."""
        if all(o.lease_id != lease_id for o in self.deltas):
            self.deltas.append(OwnDelta(lease_id, body))

    def acked(self, lease_id: int, ack: protocol.DeltaAccepted) -> None:
        for own in self.deltas:
            if own.lease_id == lease_id:
                own.seq = ack.will_merge_into

    def refused(self, lease_id: int) -> None:
        """It will never be merged."""
        self.deltas = [o for o in self.deltas if o.lease_id != lease_id]

    def ahead_of(self, lease: protocol.Lease, base: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """The sum of this worker's own pseudo-gradients that `lease`'s base does not hold: those
        still uploading or queued (no sequence number yet) and those acknowledged as a version above
        the base."""
        self.deltas = [o for o in self.deltas if o.seq is None or o.seq > lease.base_version][-self.KEEP:]
        if not ALGORITHMS[lease.algorithm].leases_ahead or base is None or not self.deltas:
            return None
        schema = {n: tuple(t.shape) for n, t in base.items()}
        sents = []
        for own in self.deltas:
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
                      lease.lease_id, lease.base_version, len(self.deltas))
        return ahead or None
