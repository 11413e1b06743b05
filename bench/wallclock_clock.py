"""`bench wallclock`'s clock: a training run's curve of loss against tokens, put on simulated seconds
for one set of links (bench/links.py), by how the row communicates:

- ddp: every step, compute then the gradient's ring all-reduce, overlapped bucket by bucket with
  backward (the compressor's own time added to the step's compute);
- alone: compute only;
- worker: the idletrain worker's rounds (H steps, plus the round's compression), its delta uploaded
  during the next round, the next base downloaded during the round before, each through the
  coordinator's link shared by every worker; sparta exchanges in the background of each step, at most
  MAX_EXCHANGES_IN_FLIGHT at once (worker/exchanges.py), the step waiting when the link falls behind.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from bench.links import HTTP_OVERHEAD_BYTES, Link, ddp_step_s, through_coordinator, time_at_tokens, worker_arrivals

MAX_EXCHANGES_IN_FLIGHT = 4  # the worker's default (worker/trainer.py max_exchanges_in_flight)


@dataclasses.dataclass(frozen=True)
class Compute:
    step_s: float  # one worker's step on its batch, calibrated once for every row
    tokens_per_step: int  # one worker's
    workers: int


@dataclasses.dataclass(frozen=True)
class RowTraffic:
    """What a row sends, as its clock needs it (bytes per worker)."""

    payload_bytes_per_step: int = 0  # ddp: what each worker all-reduces per step
    allreduces: int = 1  # ddp: all-reduces in a row per step (PowerSGD: 2)
    extra_step_s: float = 0.0  # ddp: the compressor's seconds per step
    rounds: int = 0  # worker: rounds per worker
    H: int = 0  # worker: steps per round
    delta_bytes_up: float = 0.0  # worker: all its deltas (the sparta exchanges not included)
    update_bytes_down: float = 0.0  # worker: all its base downloads (updates, snapshots)
    exchange_bytes: tuple[int, int] = (0, 0)  # worker: (up, down) of one sparta exchange, one per step
    extra_round_s: float = 0.0  # worker: compressing and encoding a round's delta

    def as_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}


def ddp_clock(traffic: RowTraffic, compute: Compute, links: Sequence[Link]) -> tuple[float, int]:
    """(seconds per step, buckets) of a ddp row."""
    return ddp_step_s(compute.step_s + traffic.extra_step_s, links, traffic.payload_bytes_per_step,
                      allreduces=traffic.allreduces)


def worker_step_s(traffic: RowTraffic, compute: Compute, link: Link) -> float:
    """A worker step's seconds with its sparta exchange in the background: compute, or the exchange's
    share of the link when that is longer (the step waits rather than skip, so the training matches)."""
    up, down = traffic.exchange_bytes
    if not up and not down:
        return compute.step_s
    return max(compute.step_s, link.request_s(up, down) / MAX_EXCHANGES_IN_FLIGHT,
               link.up_s(up + HTTP_OVERHEAD_BYTES), link.down_s(down + HTTP_OVERHEAD_BYTES))


def worker_timeline(traffic: RowTraffic, compute: Compute, links: Sequence[Link], *,
                    coordinator: Link | None) -> list[tuple[float, float]]:
    """(seconds, tokens merged by then) for a worker row: every worker's round arrivals merged."""
    arrivals = []
    rounds, H = traffic.rounds, traffic.H
    for link in links:
        link = through_coordinator(link, coordinator, compute.workers)
        step = worker_step_s(traffic, compute, link)
        ex_up = link.up_s(traffic.exchange_bytes[0] + HTTP_OVERHEAD_BYTES) * H if traffic.exchange_bytes[0] else 0.0
        up = [link.request_s(traffic.delta_bytes_up / rounds, 0) + ex_up] * rounds
        # round 0's base is built from the run's seed: only the lease; later rounds add the update
        per_update = traffic.update_bytes_down / max(1, rounds - 1)
        down = [link.request_s(0, 0)] + [link.request_s(0, 0) + link.request_s(0, per_update)] * (rounds - 1)
        arrivals.append(worker_arrivals(H * step + traffic.extra_round_s, up, down, depth=1))
    return time_at_tokens(arrivals, H * compute.tokens_per_step)


def curve_on_links(curve: Sequence[tuple[int, float]], pattern: str, traffic: RowTraffic, compute: Compute,
                   links: Sequence[Link], *, coordinator: Link | None) -> dict:
    """The run's (tokens, loss) curve as (seconds, loss) on these links, and the clock's parameters."""
    if pattern == "ddp":
        step_s, buckets = ddp_clock(traffic, compute, links)
        per_token = step_s / (compute.workers * compute.tokens_per_step)
        return {"step_s": step_s, "buckets": buckets, "curve": [(t * per_token, loss) for t, loss in curve]}
    if pattern == "alone":
        per_token = compute.step_s / compute.tokens_per_step
        return {"step_s": compute.step_s, "curve": [(t * per_token, loss) for t, loss in curve]}
    if pattern != "worker":
        raise ValueError(f"unknown pattern {pattern!r}")
    timeline = worker_timeline(traffic, compute, links, coordinator=coordinator)
    tokens = [tok for _, tok in timeline]
    timed = []
    for t, loss in curve:
        if t <= 0:
            timed.append((0.0, loss))
            continue
        i = min(bisect.bisect_left(tokens, t - 1e-9), len(timeline) - 1)  # the arrival that delivered token t
        timed.append((timeline[i][0], loss))
    return {"step_s": worker_step_s(traffic, compute, links[0]), "last_arrival_s": timeline[-1][0], "curve": timed}


def clock_all(trained: Sequence[tuple[object, list[dict]]], compute: Compute, links: Sequence[Sequence[Link]], *,
              coordinator: Link | None) -> None:
    """Every run of every (row, runs) pair gets its "clock": its curve on each set of links, in place."""
    for row, runs in trained:
        for r in runs:
            r["clock"] = [curve_on_links(r["result"].curve, row.pattern, r["traffic"], compute, ls,
                                         coordinator=coordinator) for ls in links]


__all__ = ["Compute", "MAX_EXCHANGES_IN_FLIGHT", "RowTraffic", "clock_all", "curve_on_links", "worker_timeline"]
