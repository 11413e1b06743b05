"""The worker API range the coordinator serves: /healthz says it, a worker outside it gets 426 with
the range and what to install, one inside it (or a request without the header) is served; a 413
says the cap it enforced."""

from __future__ import annotations

import pytest

from coordinator.api import deps
from shared import protocol

API = protocol.API_PREFIX


def test_healthz_says_the_range_and_what_to_install(api):
    health = protocol.Health.model_validate(api.client.get("/healthz").json())
    assert (health.min_api_version, health.api_version) == (protocol.MIN_API_VERSION, protocol.API_VERSION)
    assert health.worker_install == deps.worker_install() and "idletrain" in health.worker_install


@pytest.mark.parametrize("version", [protocol.MIN_API_VERSION - 1, protocol.API_VERSION + 1])
def test_a_worker_outside_the_range_is_answered_426_naming_it(api, run, version):
    headers = {**api.register(), protocol.H_API_VERSION: str(version)}
    resp = api.client.post(f"{API}/runs/t/leases", headers=headers)
    assert resp.status_code == 426, resp.text
    body = resp.json()
    assert body["min_api_version"] == protocol.MIN_API_VERSION and body["api_version"] == protocol.API_VERSION
    assert body["worker_install"] == deps.worker_install()
    assert f"not v{version}" in body["detail"] and deps.worker_install() in body["detail"]
    # nothing was leased: the same worker at the current version gets the first shard's lease
    lease = api.lease({k: v for k, v in headers.items() if k != protocol.H_API_VERSION})
    assert lease.lease_id == 1
    # /healthz answers whatever the worker's version, so it can learn the range
    assert api.client.get("/healthz", headers={protocol.H_API_VERSION: str(version)}).status_code == 200


def test_a_worker_inside_the_range_or_without_the_header_is_served(api, run):
    headers = api.register()
    for version in range(protocol.MIN_API_VERSION, protocol.API_VERSION + 1):
        assert api.client.get(f"{API}/runs/t/status", headers={protocol.H_API_VERSION: str(version)}).status_code == 200
    assert api.client.get(f"{API}/runs/t/status").status_code == 200  # curl, the operator's commands
    api.lease(headers)


def test_a_version_that_is_not_a_number_is_refused_with_400(api, run):
    resp = api.client.get(f"{API}/runs/t/status", headers={protocol.H_API_VERSION: "two"})
    assert resp.status_code == 400 and protocol.H_API_VERSION in resp.json()["detail"]


def test_413_says_the_cap(open_api, settings, run_config):
    with open_api(settings) as api:
        api.create_run(run_config())
    # the operator lowers the cap below this run's deltas (run create refuses such a run; a restart does not)
    with open_api(settings.model_copy(update={"max_upload_bytes": 4096})) as api:
        headers = api.register()
        lease = api.lease(headers)
        resp = api.upload(lease.lease_id, b"\0" * 5000, headers)
        assert resp.status_code == 413
        assert resp.headers[protocol.H_MAX_BODY] == "4096" and "4096" in resp.json()["detail"]


@pytest.mark.parametrize("algorithm,compression,needs,inner", [
    ("diloco", {}, 2, {}), ("diloco", {"index": "topk", "fraction": 0.02, "values": "int2"}, 3, {}),
    ("diloco", {"index": "topk", "fraction": 0.02, "feedback_decay": 0.95}, 3, {}),
    ("sparta+diloco", {"index": "topk", "fraction": 0.02, "values": "int2"}, 3, {}),
    ("sparta", {"index": "topk", "fraction": 0.02, "values": "int2", "feedback_decay": 0.95}, 2, {}),
    ("diloco", {}, 3, {"second_moment_workers": 2}), ("diloco", {"values": "int1"}, 4, {}),
    ("diloco", {"values": "int1", "feedback_decay": 0.9}, 4, {"second_moment_workers": 2})])
def test_a_v2_worker_takes_leases_of_runs_it_can_read_and_is_told_to_upgrade_for_the_others(
        api, run_config, algorithm, compression, needs, inner):
    """A run needs v3 only when its rounds end with a pseudo-gradient cut down by int2 or a decay (a
    sparta round compresses nothing, and its lease carries the default compression, which v2 reads),
    or when its workers' AdamW is normalised for the group; v4 when it is cut down to int1."""
    cfg = run_config(algorithm=algorithm, compression=compression, inner=inner)
    assert protocol.lease_api_version(protocol.RunConfig.model_validate(cfg)) == needs
    api.create_run(cfg)
    headers = {**api.register(), protocol.H_API_VERSION: "2"}
    resp = api.client.post(f"{API}/runs/t/leases", headers=headers)
    if needs == 2:  # the lease reads as version 2 wrote it: no feedback_decay, no int2 in its compression
        assert resp.status_code == 200, resp.text
        assert "feedback_decay" not in resp.json()["compression"] and resp.json()["compression"]["values"] != "int2"
        return
    assert resp.status_code == 426, resp.text
    body = resp.json()
    assert body["min_api_version"] == needs and body["api_version"] == protocol.API_VERSION
    assert f"need worker API v{needs}, not v2" in body["detail"] and deps.worker_install() in body["detail"]
    if needs == 4:  # and a version-3 worker is refused the same way
        resp = api.client.post(f"{API}/runs/t/leases", headers={**headers, protocol.H_API_VERSION: "3"})
        assert resp.status_code == 426 and resp.json()["min_api_version"] == 4, resp.text
    # nothing was leased: a current worker gets the first lease, and reads the run's compression
    lease = api.lease({k: v for k, v in headers.items() if k != protocol.H_API_VERSION})
    assert lease.lease_id == 1 and lease.compression == protocol.RunConfig.model_validate(cfg).compression

def test_a_default_runs_public_config_reads_as_version_2_wrote_it(api, run_config):
    """A version-2 worker following the coordinator validates GET /runs/{run}/config strictly: a default
    run's has none of version 3's fields; a run that sets them says them."""
    api.create_run(run_config())
    api.create_run(run_config("w", outer={"warmup": 4}, compression={"index": "topk", "feedback_decay": 0.9}))
    plain = api.client.get(f"{API}/runs/t/config").json()
    assert "warmup" not in plain["outer"] and "feedback_decay" not in plain["compression"]
    warm = api.client.get(f"{API}/runs/w/config").json()
    assert (warm["outer"]["warmup"], warm["compression"]["feedback_decay"]) == (4, 0.9)
