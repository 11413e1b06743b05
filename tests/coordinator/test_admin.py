"""The admin token (coordinator/admin.py, api/deps.py require_admin): generated on first start when
none is given, kept 0600, reused after a restart, and always required by every operator route —
there is no open mode a cross-origin POST or a loopback neighbour could use."""

from __future__ import annotations

import logging
import stat

import pytest

from coordinator import admin
from coordinator.settings import CoordinatorSettings
from shared.errors import ConfigError
from tests.conftest import API
from tests.coordinator.test_auth_routes import ADMIN_ROUTES


def _fill(path: str, worker_id: int) -> str:
    return path.replace("{run}", "t").replace("{worker_id}", str(worker_id))


def test_a_token_is_generated_once_kept_0600_and_reused(tmp_path, open_api, caplog):
    settings = CoordinatorSettings(data_dir=tmp_path / "coord")
    path = tmp_path / "coord" / "admin_token"
    with caplog.at_level(logging.WARNING, logger="coordinator.admin"):
        with open_api(settings) as api:
            token = api.client.app.state.admin_token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() == token and len(token) >= 32
    assert caplog.text.count("admin token generated") == 1 and str(path) in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="coordinator.admin"):
        with open_api(settings) as api:  # a restart: the same token, not a new one, and nothing said
            assert api.client.app.state.admin_token == token
    assert "admin token generated" not in caplog.text


def test_a_given_token_wins_and_writes_no_file(tmp_path):
    assert admin.ensure_token(tmp_path, "given-token-0123456789") == ("given-token-0123456789", False)
    assert not (tmp_path / "admin_token").exists()


def test_a_token_file_open_to_others_stops_the_start(tmp_path, open_api):
    token, created = admin.ensure_token(tmp_path / "coord")
    assert created
    (tmp_path / "coord" / "admin_token").chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600"):
        with open_api(CoordinatorSettings(data_dir=tmp_path / "coord")):
            pass
    (tmp_path / "coord" / "admin_token").write_text("short\n")
    (tmp_path / "coord" / "admin_token").chmod(0o600)
    with pytest.raises(ConfigError, match="16"):
        admin.ensure_token(tmp_path / "coord")


def test_every_operator_route_needs_the_generated_token(tmp_path, open_api, run_config):
    """The attack: with no token configured, every operator action used to be open."""
    with open_api(CoordinatorSettings(data_dir=tmp_path / "coord")) as api:
        api.create_run(run_config())
        worker = api.register(name="w")
        worker_id = api.operator("get", f"{API}/runs/t/workers").json()[0]["worker_id"]
        assert ADMIN_ROUTES, "no operator route found"
        for method, path in ADMIN_ROUTES:
            url = _fill(path, worker_id)
            body = {"json": run_config("new")} if (method, path) == ("POST", f"{API}/runs") else {}
            missing = api.client.request(method, url, **body)
            assert missing.status_code == 401, (method, path, missing.text)
            assert "--admin-token" in missing.json()["detail"]
            for token in ("x" * 43, worker["Authorization"][7:]):
                wrong = api.client.request(method, url, headers={"Authorization": f"Bearer {token}"}, **body)
                assert wrong.status_code == 403, (method, path, wrong.text)
        # nothing changed: no new run, "t" still active and unevaluated since creation, the worker in good standing
        assert [r["name"] for r in api.client.get(f"{API}/runs").json()] == ["t"]
        status = api.status()
        assert status["state"] == "active" and len(status["eval_history"]) == 1
        (info,) = api.operator("get", f"{API}/runs/t/workers").json()
        assert info["standing"] == "ok" and not info["revoked"]
        assert api.lease(worker).base_version == 0


def test_a_cross_origin_post_without_the_header_cannot_pause_a_run(api, run):
    """CSRF: a page elsewhere can make the browser POST with no body and no Authorization; the token
    in a cookie or the query string is not looked at either."""
    token = api.client.app.state.admin_token
    for params, cookie in (({}, None), ({"token": token}, None), ({"admin_token": token}, None),
                           ({}, "admin_token"), ({}, "token")):
        api.client.cookies.clear()
        if cookie:
            api.client.cookies.set(cookie, token)
        resp = api.client.post(f"{API}/runs/t/pause", params=params, headers={"Origin": "http://evil.example"})
        assert resp.status_code == 401, (params, cookie, resp.text)
        assert "access-control-allow-origin" not in resp.headers
    api.client.cookies.clear()
    assert api.status()["state"] == "active"
    # the preflight a browser must send before adding Authorization cross-origin is not granted
    pre = api.client.options(f"{API}/runs/t/pause", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"})
    assert "access-control-allow-origin" not in pre.headers
    assert api.status()["state"] == "active"
