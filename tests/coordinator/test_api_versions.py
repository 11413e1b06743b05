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
