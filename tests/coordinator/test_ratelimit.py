"""coordinator/ratelimit.py: buckets that refilled are dropped (memory bounded, answers unchanged),
and registrations are counted per client address with an IPv6 client counted by its /64."""

from __future__ import annotations

import math
import random

import pytest

from coordinator.errors import TooManyRequests
from coordinator.ratelimit import RateLimiter, client_key
from shared import protocol


def test_sweeping_full_buckets_never_changes_an_answer():
    """The same requests (keys, actions, times) against a limiter that sweeps every second and one
    that never does: every answer identical, to the bit, while the sweeping one holds fewer buckets."""
    limits = {"register": (1.0, 8.0), "lease": (2.0, 3.0), "off": (0.0, 1.0)}
    t = [0.0]
    swept = RateLimiter(limits, clock=lambda: t[0], sweep_s=1.0)
    kept = RateLimiter(limits, clock=lambda: t[0], sweep_s=math.inf)
    rng = random.Random(0)
    smaller = 0
    for _ in range(20_000):
        t[0] += rng.expovariate(20.0)  # ~20 requests a second, from 50 keys: buckets empty and refill
        action, key = rng.choice(["register", "lease", "off"]), rng.randrange(50)
        assert swept.take(action, key) == kept.take(action, key)
        smaller += len(swept) < len(kept)
    assert smaller > 0  # the sweep did drop buckets (else this test compares two identical limiters)


def test_a_hundred_thousand_keys_leave_a_bounded_dict():
    """1e5 distinct addresses at 1,000 a second: only the buckets of the last refill time (burst /
    rate = 8 s) plus one sweep interval stay, not one per address ever seen."""
    t = [0.0]
    rl = RateLimiter({"register": (1.0, 8.0)}, clock=lambda: t[0])
    most = 0
    for i in range(100_000):
        t[0] += 0.001
        assert rl.take("register", f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}") == 0.0
        most = max(most, len(rl))
    # a bucket taken once refills in 1 s; a sweep every SWEEP_S (10 s) drops it: at most ~11 s of keys
    assert most <= 1000 * (RateLimiter.SWEEP_S + 2)
    assert len(rl) < 100_000 / 5


def test_client_key_counts_an_ipv6_client_by_its_64():
    assert client_key("2001:db8:1:2::1") == client_key("2001:db8:1:2:ffff:ffff:ffff:ffff") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("[2001:db8:1:2::7]") == "2001:db8:1:2::/64"
    assert client_key("::ffff:192.0.2.1") == client_key("192.0.2.1") == "192.0.2.1"
    assert client_key("192.0.2.1") != client_key("192.0.2.2")
    assert client_key(None) == client_key("") == "?"
    assert client_key("testclient") == "testclient"


def test_two_ipv6_addresses_of_one_64_share_a_registration_bucket(open_api, settings, run_config):
    """An attacker with a /64 (any home connection) cycling its addresses gets one burst, not 2^64."""
    settings = settings.model_copy(update={"register_rate": 0.001, "register_burst": 1.0})
    with open_api(settings) as api:
        api.create_run(run_config())
        coord, req = api.coordinator, protocol.RegisterRequest(team="w")  # unnamed: a name is claimed once
        coord.workers.register("t", req, client="2001:db8:1:2::1")
        with pytest.raises(TooManyRequests, match="2001:db8:1:2::/64") as refused:
            coord.workers.register("t", req, client="2001:db8:1:2::dead:beef")
        assert refused.value.status_code == 429 and int(refused.value.headers["Retry-After"]) >= 1
        coord.workers.register("t", req, client="2001:db8:1:3::1")  # the next /64 is another client
        assert len(coord.workers.list("t")) == 2
