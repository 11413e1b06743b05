"""Host validation against DNS rebinding (coordinator/hosts.py): only the names the coordinator is
known by are answered; any other Host gets 400 and changes nothing."""

from __future__ import annotations

import pytest

from coordinator import hosts
from coordinator.settings import CoordinatorSettings
from tests.conftest import API


@pytest.mark.parametrize(("header", "name"), [
    ("127.0.0.1:8000", "127.0.0.1"), ("LOCALHOST", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
    ("train.example.org", "train.example.org"), ("evil.example:80", "evil.example"), ("::1", "::1"),
])
def test_host_name_drops_the_port_and_brackets(header, name):
    assert hosts.host_name(header) == name


def test_loopback_bind_allows_the_loopback_names_and_no_other():
    allowed = hosts.allowed_hosts(CoordinatorSettings(data_dir="unused"))
    for ok in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "127.0.0.2"):
        assert hosts.is_allowed(ok, allowed), ok
    for bad in ("evil.example", "evil.example:8000", "localhost.evil.example", "", None, "10.0.0.5"):
        assert not hosts.is_allowed(bad, allowed), bad


def test_listed_names_and_subdomain_patterns_are_allowed():
    allowed = hosts.allowed_hosts(CoordinatorSettings(data_dir="unused", host="10.0.0.5",
                                                      allowed_hosts="train.example.org, *.lab.example"))
    for ok in ("10.0.0.5:8000", "train.example.org", "TRAIN.example.org:443", "gpu1.lab.example", "127.0.0.1"):
        assert hosts.is_allowed(ok, allowed), ok
    for bad in ("example.org", "lab.example.evil", "evil.example"):
        assert not hosts.is_allowed(bad, allowed), bad


def test_binding_every_address_answers_any_name_unless_names_are_listed():
    # a public server's Host is its public name, which it cannot know: the admin token guards it
    assert hosts.allowed_hosts(CoordinatorSettings(data_dir="unused", host="0.0.0.0")) is None
    assert hosts.allowed_hosts(CoordinatorSettings(data_dir="unused", host="::")) is None
    listed = hosts.allowed_hosts(CoordinatorSettings(data_dir="unused", host="0.0.0.0", allowed_hosts="a.example"))
    assert hosts.is_allowed("a.example", listed) and not hosts.is_allowed("b.example", listed)


def test_a_rebound_name_is_refused_and_changes_nothing(api, run):
    """The attack: evil.example re-resolved to 127.0.0.1, the browser sends its requests with that Host."""
    admin = api.admin  # even a request that carries the right token: the name alone is refused
    evil = {"Host": "evil.example:8000"}
    for method, path, extra in (("post", f"{API}/runs/t/pause", admin), ("post", f"{API}/runs/t/workers", {}),
                                ("get", f"{API}/runs/t/status", {}), ("get", "/", {})):
        resp = api.client.request(method.upper(), path, headers={**extra, **evil}, json={} if method == "post" else None)
        assert resp.status_code == 400, (path, resp.text)
        assert "evil.example" in resp.json()["detail"] and "IDLETRAIN_ALLOWED_HOSTS" in resp.json()["detail"]
    status = api.status()  # Host 127.0.0.1: answered
    assert status["state"] == "active" and status["workers_total"] == 0
    assert api.client.get(f"{API}/runs/t/status", headers={"Host": "localhost:8000"}).status_code == 200


def test_a_listed_name_is_answered(tmp_path, open_api, run_config):
    settings = CoordinatorSettings(data_dir=tmp_path / "c", allowed_hosts=["train.example.org"])
    with open_api(settings) as api:
        api.create_run(run_config())
        resp = api.client.get(f"{API}/runs/t/status", headers={"Host": "train.example.org"})
        assert resp.status_code == 200
        assert api.client.get(f"{API}/runs/t/status", headers={"Host": "other.example.org"}).status_code == 400
