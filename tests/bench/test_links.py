"""bench/links.py: bytes -> seconds over a link, the ring all-reduce, ddp's overlap, the worker's rounds
(hand-computed numbers)."""

from __future__ import annotations

import pytest

from bench.links import (HTTP_OVERHEAD_BYTES, Link, bucketed_step_s, ddp_step_s, ring_allreduce_s, spread_links,
                         through_coordinator, time_at_tokens, worker_arrivals)

HOME = Link.mbit(10, 50, 30)


def test_bytes_to_seconds():
    assert HOME.up_bps == 10e6 and HOME.down_bps == 50e6 and HOME.rtt_s == 0.03
    assert HOME.up_s(1_250_000) == pytest.approx(1.0)  # 10 Mbit up: 1.25 MB a second
    assert HOME.down_s(1_250_000) == pytest.approx(0.2)
    # a request: the round trip, 1.25 MB up with its headers, the answer's headers down
    assert HOME.request_s(1_250_000 - HTTP_OVERHEAD_BYTES, 0) == pytest.approx(0.03 + 1.0 + 8 * 500 / 50e6)


@pytest.mark.parametrize("up, down, rtt", [(0, 1, 0), (1, -1, 0), (1, 1, -0.1), (float("inf"), 1, 0)])
def test_a_link_refuses_nonsense(up, down, rtt):
    with pytest.raises(ValueError):
        Link(up, down, rtt)


def test_ring_allreduce():
    # 4 workers, 4 MB each: 6 hops of a 1 MB chunk at 10 Mbit/s (0.8 s) plus half a round trip
    assert ring_allreduce_s([HOME] * 4, 4e6) == pytest.approx(6 * (0.8 + 0.015))
    # (each worker sends 2(N-1)/N of the buffer: 6 chunks of 1 MB = 1.5 x 4 MB); alone, nothing to do
    assert ring_allreduce_s([HOME], 4e6) == 0.0
    slow_up = Link.mbit(5, 50, 30)
    assert ring_allreduce_s([HOME, HOME, slow_up, HOME], 4e6) == pytest.approx(6 * (1.6 + 0.015))
    slow_down = Link.mbit(10, 4, 30)  # worker 1 receives at 4 Mbit/s: the hop into it takes 2 s
    assert ring_allreduce_s([HOME, slow_down, HOME, HOME], 4e6) == pytest.approx(6 * (2.0 + 0.015))


def test_bucketed_step_overlaps_backward():
    # compute 3 s: forward 1, backward 2
    assert bucketed_step_s(3.0, [1.0]) == pytest.approx(4.0)  # one bucket: nothing overlaps
    assert bucketed_step_s(3.0, [0.5, 0.5]) == pytest.approx(3.5)  # the first half goes during backward
    assert bucketed_step_s(3.0, [0.1] * 4) == pytest.approx(3.1)  # only the last bucket's tail shows
    assert bucketed_step_s(3.0, [2.0, 2.0]) == pytest.approx(6.0)  # communication-bound: 2 + 2 + 2
    assert bucketed_step_s(3.0, []) == 3.0


def test_ddp_picks_the_best_bucketing():
    # 2 workers, 1 MB at 8 Mbit/s: the whole all-reduce takes 1 s of transfer; 0.2 s round trips
    links = [Link(8e6, 8e6, 0.2)] * 2
    # 1 bucket: 3 + 1 + 0.2 = 4.2; 2: 3.7; 4 (0.45 s each): 3.45; 8 (0.325 s each, queued): 3.85
    assert ddp_step_s(3.0, links, 1e6) == (pytest.approx(3.45), 4)
    # no latency: the most buckets, only 1/64 of the transfer left after backward
    assert ddp_step_s(3.0, [Link(8e6, 8e6, 0.0)] * 2, 1e6) == (pytest.approx(3 + 1 / 64), 64)
    # two all-reduces in a row (PowerSGD), each of half the bytes: twice the latency
    step, buckets = ddp_step_s(3.0, links, 1e6, allreduces=2, max_buckets=1)
    assert (step, buckets) == (pytest.approx(3 + 2 * (0.5 + 0.2)), 1)


def test_worker_uploads_during_the_next_round():
    # compute 10 s a round, uploads of 2 s hidden behind the next round
    assert worker_arrivals(10, [2] * 3, [0] * 3) == pytest.approx([12, 22, 32])
    # no overlap (depth 0): each round waits for its own upload
    assert worker_arrivals(10, [2] * 3, [0] * 3, depth=0) == pytest.approx([12, 24, 36])
    # uploads of 15 s: one in flight at most, the uplink sets the pace
    assert worker_arrivals(10, [15] * 3, [0] * 3) == pytest.approx([25, 40, 55])


def test_worker_downloads_during_the_round_before():
    # the first base: 1 s before round 0; later ones (5 s) download during the round before
    assert worker_arrivals(10, [0] * 3, [1, 5, 5]) == pytest.approx([11, 21, 31])
    # downloads of 15 s: the downlink sets the pace
    assert worker_arrivals(10, [0] * 3, [1, 15, 15]) == pytest.approx([11, 26, 41])
    with pytest.raises(ValueError):
        worker_arrivals(10, [0] * 3, [0] * 2)


def test_heterogeneous_links_and_the_coordinator():
    links = spread_links(HOME, 3, 4.0)
    assert [link.up_bps for link in links] == pytest.approx([10e6, 5e6, 2.5e6])
    assert [link.down_bps for link in links] == pytest.approx([50e6, 25e6, 12.5e6])
    assert spread_links(HOME, 1, 4.0) == (HOME,)
    # 8 workers through a 100 Mbit/s coordinator: 12.5 Mbit/s each at most
    shared = through_coordinator(HOME, Link.mbit(100, 100, 0), 8)
    assert (shared.up_bps, shared.down_bps, shared.rtt_s) == (10e6, 12.5e6, 0.03)
    assert through_coordinator(HOME, None, 8) == HOME


def test_arrivals_become_tokens_delivered():
    assert time_at_tokens([[12, 22], [15, 30]], 100) == [(12, 100), (15, 200), (22, 300), (30, 400)]
