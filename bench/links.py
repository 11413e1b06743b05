"""A pure link model for `bench wallclock`: seconds for the bytes a method sends, over home links.

A `Link` is one machine's connection: uplink and downlink in bit/s and a round-trip time. On it:

- a request (`request_s`): one round trip, then the bytes at the link's rate in each direction
  (headers counted as HTTP_OVERHEAD_BYTES each way);
- a ring all-reduce (`ring_allreduce_s`): 2(N-1) hops, each moving a 1/N chunk from every worker to
  the next at once, so a hop lasts as long as the slowest pair (one-way latency + chunk / rate);
- ddp's step (`ddp_step_s`): gradients all-reduced bucket by bucket while backward still runs, as
  torch DDP does; the step ends when compute and the last bucket's all-reduce are both done;
- the idletrain worker's rounds (`worker_arrivals`): the upload of round k runs while round k+1
  trains (at most `depth` uploads behind), and the next round's base downloads during the round
  before it (worker/delivery.py, worker/prefetch.py);
- heterogeneous links (`spread_links`) and the coordinator's own link shared by every worker at once
  (`through_coordinator`).

What it leaves out, on purpose (docs/BENCHMARKS.md, "Wall-clock"): congestion from other traffic, packet
loss, TCP slow start and window limits, and any time the coordinator spends merging.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

HTTP_OVERHEAD_BYTES = 500  # request line + headers, or status line + headers, of one HTTP/1.1 message
MBIT = 1e6


@dataclasses.dataclass(frozen=True)
class Link:
    """One machine's connection: rates in bit/s, round-trip time in seconds."""

    up_bps: float
    down_bps: float
    rtt_s: float

    def __post_init__(self) -> None:
        if not (self.up_bps > 0 and self.down_bps > 0 and math.isfinite(self.up_bps + self.down_bps)):
            raise ValueError(f"link rates must be positive and finite, got up {self.up_bps}, down {self.down_bps}")
        if not (self.rtt_s >= 0 and math.isfinite(self.rtt_s)):
            raise ValueError(f"link round-trip time must be 0 or more seconds, got {self.rtt_s}")

    @classmethod
    def mbit(cls, up_mbps: float, down_mbps: float, rtt_ms: float) -> Link:
        return cls(up_mbps * MBIT, down_mbps * MBIT, rtt_ms / 1000)

    def up_s(self, n_bytes: float) -> float:
        """Seconds to push n_bytes up, without the latency."""
        return 8 * n_bytes / self.up_bps

    def down_s(self, n_bytes: float) -> float:
        return 8 * n_bytes / self.down_bps

    def request_s(self, up_bytes: float, down_bytes: float) -> float:
        """One HTTP request: a round trip, the body and headers up, then the answer's down."""
        return (self.rtt_s + self.up_s(up_bytes + HTTP_OVERHEAD_BYTES)
                + self.down_s(down_bytes + HTTP_OVERHEAD_BYTES))

    def label(self) -> str:
        return f"{self.up_bps / MBIT:g}/{self.down_bps / MBIT:g} Mbit/s, {self.rtt_s * 1000:g} ms"


def spread_links(base: Link, workers: int, spread: float) -> tuple[Link, ...]:
    """`workers` links whose rates spread geometrically from base's down to base's / spread (worker 0
    has base's rates, the last 1/spread of them); the same round-trip time for all."""
    if workers < 1 or spread < 1:
        raise ValueError(f"need workers >= 1 and spread >= 1, got {workers}, {spread}")
    if workers == 1:
        return (base,)
    return tuple(dataclasses.replace(base, up_bps=base.up_bps / spread ** (i / (workers - 1)),
                                     down_bps=base.down_bps / spread ** (i / (workers - 1)))
                 for i in range(workers))


def through_coordinator(link: Link, coordinator: Link | None, workers: int) -> Link:
    """A worker's link as seen through a coordinator that every worker uses at the same time: the
    coordinator's downlink (uplink) shared equally by the workers' uploads (downloads). The round trip
    is the worker's (the coordinator sits in a datacenter). None: no coordinator bound."""
    if coordinator is None:
        return link
    return dataclasses.replace(link, up_bps=min(link.up_bps, coordinator.down_bps / workers),
                               down_bps=min(link.down_bps, coordinator.up_bps / workers))


def ring_allreduce_s(links: Sequence[Link], n_bytes: float) -> float:
    """A ring all-reduce of n_bytes per worker: reduce-scatter then all-gather, 2(N-1) hops; in each
    hop every worker i sends an n_bytes/N chunk to worker i+1, so the hop lasts as long as the slowest
    (uplink of i, downlink of i+1) pair plus a one-way latency (half the larger round trip). Each
    worker sends and receives 2(N-1)/N * n_bytes in all."""
    n = len(links)
    if n < 2:
        return 0.0
    chunk_bits = 8 * n_bytes / n
    hop = max(max(a.rtt_s, b.rtt_s) / 2 + chunk_bits / min(a.up_bps, b.down_bps)
              for a, b in zip(links, links[1:] + links[:1]))
    return 2 * (n - 1) * hop


def bucketed_step_s(compute_s: float, bucket_comm_s: Sequence[float], *, backward_share: float = 2 / 3) -> float:
    """One step whose gradient is communicated in buckets as backward produces them: forward takes
    (1 - backward_share) of compute_s, bucket j is ready once (j+1)/B of backward is done, and the
    buckets go over the network one after another. The step ends when compute and the last bucket
    are both done: max(compute, comm) plus the tail that cannot overlap."""
    if not bucket_comm_s:
        return compute_s
    forward_s = (1 - backward_share) * compute_s
    backward_s = backward_share * compute_s
    end = 0.0
    for j, comm in enumerate(bucket_comm_s):
        ready = forward_s + backward_s * (j + 1) / len(bucket_comm_s)
        end = max(end, ready) + comm
    return max(compute_s, end)


def ddp_step_s(compute_s: float, links: Sequence[Link], grad_bytes: float, *, allreduces: int = 1,
               max_buckets: int = 64) -> tuple[float, int]:
    """(seconds per ddp step, buckets): the gradient of grad_bytes per worker ring all-reduced in B
    equal buckets overlapped with backward, B the power of two up to max_buckets that makes the step
    shortest (more buckets overlap more but pay the ring's latency more often: the best bucketing, so
    ddp is not tuned down). allreduces: all-reduces in a row per bucket (PowerSGD: 2, P then Q)."""
    best = (math.inf, 1)
    buckets = 1
    while buckets <= max_buckets:
        comm = allreduces * ring_allreduce_s(links, grad_bytes / (buckets * allreduces))
        best = min(best, (bucketed_step_s(compute_s, [comm] * buckets), buckets))
        buckets *= 2
    return best


def worker_arrivals(round_compute_s: float, up_s: Sequence[float], down_s: Sequence[float], *,
                    depth: int = 1) -> list[float]:
    """When each round's delta has reached the coordinator, for one worker that trains rounds back to
    back as the real worker does: round k's base downloads (down_s[k]: the lease and the update)
    during round k-1, round k's upload (up_s[k]) starts when round k ends and the uplink is free, and
    round k+1 starts once round k ended, its base is in, and at most `depth` uploads are still running
    (depth 1: worker/delivery.py, one upload in the background; depth 0: no overlap at all, the round
    waits for its own upload)."""
    if len(up_s) != len(down_s):
        raise ValueError("one upload and one download time per round")
    if depth < 0:
        raise ValueError(f"depth must be 0 or more, got {depth}")
    arrivals: list[float] = []
    start = prev_start = down_end = 0.0
    up_end = 0.0
    for k in range(len(up_s)):
        down_end = max(prev_start if k else 0.0, down_end) + down_s[k]
        if k:
            waits = arrivals[k - 1 - depth] if k - 1 - depth >= 0 else 0.0
            start = max(start + round_compute_s, down_end, waits)
        else:
            start = down_end
        prev_start = start
        up_end = max(start + round_compute_s, up_end) + up_s[k]
        arrivals.append(up_end)
    return arrivals


def time_at_tokens(arrivals: Sequence[Sequence[float]], tokens_per_round: float) -> list[tuple[float, float]]:
    """Every worker's delta arrivals merged in time order: (seconds, tokens delivered by then)."""
    times = sorted(t for worker in arrivals for t in worker)
    return [(t, tokens_per_round * (i + 1)) for i, t in enumerate(times)]


__all__ = ["HTTP_OVERHEAD_BYTES", "Link", "bucketed_step_s", "ddp_step_s", "ring_allreduce_s", "spread_links",
           "through_coordinator", "time_at_tokens", "worker_arrivals"]
