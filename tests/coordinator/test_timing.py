"""Server-Timing: every answer says where its time went, phase by phase (coordinator/timing.py)."""

from __future__ import annotations

from coordinator import timing


def _phases(resp) -> dict[str, float]:
    got = timing.parse(resp.headers.get("server-timing"))
    assert "total" in got, resp.headers
    assert all(v >= 0 for v in got.values())
    # the phases follow one another (none inside another), so together they fit in the total
    assert sum(v for k, v in got.items() if k != "total") <= got["total"] + 0.05
    return got


def test_lease_and_upload_answers_carry_their_phases(api, run, make_delta):
    headers = api.register()
    resp = api.client.post("/api/v1/runs/t/leases", headers=headers)
    assert resp.status_code == 200
    assert {"auth", "lease", "total"} <= set(_phases(resp))
    lease_id = resp.json()["lease_id"]
    from shared import protocol

    lease = protocol.Lease.model_validate(resp.json())
    resp = api.upload(lease_id, make_delta(lease), headers)
    assert resp.status_code == 202
    assert {"auth", "body", "hash", "check", "validate", "ack_wait", "lock", "write", "commit"} <= set(_phases(resp))
    # a refusal says how far it got: here the lease check answers (a duplicate of another body)
    resp = api.upload(lease_id, make_delta(lease, seed=1), headers)
    assert resp.status_code == 409
    got = _phases(resp)
    assert "check" in got and "write" not in got


def test_phase_outside_a_request_does_nothing_and_parse_is_forgiving():
    with timing.phase("x"):
        pass
    assert timing.parse(None) == {}
    assert timing.parse("a;dur=1.5, b;desc=x, c;dur=oops, d;dur=2") == {"a": 1.5, "d": 2.0}
    assert timing.header_value([("a", 0.001), ("b", 0.002), ("a", 0.003)], 0.01) == \
        "a;dur=4.00, b;dur=2.00, total;dur=10.00"


def test_warm_up_builds_each_runs_schema_before_the_first_upload(settings, run_config, monkeypatch):
    """A coordinator process that does not lead checks uploads against a schema it builds itself; the
    first build in a process costs torch's one-off initialisation (~0.8 s), so it is done at start."""
    from coordinator.services import live
    from coordinator.services.coordinator import Coordinator
    from shared.config import RunConfig

    first = Coordinator(settings)
    first.runs.create(RunConfig.model_validate(run_config()))
    run_id = next(iter(first.live.runtimes))
    want = first.live.schema_of(run_id)
    first.close()

    other = Coordinator(settings)  # a second process: no live models, no schema yet
    other.live.leads = False
    other.live.warm_up()

    def no_build(*a, **k):
        raise AssertionError("the schema should have been built at warm-up")

    monkeypatch.setattr(live, "meta_schema", no_build)
    assert other.live.schema_of(run_id) == want
    other.close()
