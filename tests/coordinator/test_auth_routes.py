"""401 / 403 on every protected route, found by walking the app's routes (none is listed by hand).

A route is a *worker route* when its dependencies (route.dependant, walked recursively) include
coordinator.api.deps.current_worker, an *admin route* when they include require_admin. Routes
added later are classified and tested without editing this file; a route with neither guard must
be one of PUBLIC, so a new route that forgot its guard fails here.

With an admin token in the settings:

    admin route:   no Authorization 401, a wrong token 403, a worker's token 403, not-Bearer 401
    worker route:  no Authorization 401, an unknown token 401, the admin token 401 (it is not a
                   worker's), a revoked worker's token 403, another run's worker 403 where the
                   path names a run, another worker's token 403 where the path names a lease

Path parameters are real (run "t", a live lease of the worker, a real shard and worker id),
required query parameters and bodies are valid, so the guard and not a 404 / 422 answers. Each
route also gets a control: the right token gets past its guard (no 401 / 403, no 5xx).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import fastapi.routing
import pytest
from fastapi.routing import APIRoute
from sqlalchemy.orm import Session

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from coordinator.api.deps import current_worker, require_admin
from coordinator.app import create_app
from coordinator.models import Worker
from coordinator.settings import CoordinatorSettings
from shared import protocol
from tests.conftest import BASE_URL, TINY_MODEL

API = protocol.API_PREFIX
ADMIN_TOKEN = "auth-matrix-admin-token-0123456789"

# Routes meant to answer anyone. A new route with neither guard fails test_unguarded_routes_are_public
# until it is added here (or given CurrentWorker / AdminDep).
PUBLIC = {
    ("GET", "/healthz"),
    ("GET", f"{API}/runs"),
    ("GET", f"{API}/runs/{{run}}/status"),
    ("GET", f"{API}/runs/{{run}}/config"),
    ("GET", f"{API}/runs/{{run}}/snapshots/{{version}}"),
    ("GET", f"{API}/runs/{{run}}/updates/{{from_version}}/{{to_version}}"),
    ("GET", f"{API}/runs/{{run}}/tokenizer"),  # like the snapshots: export and sample read it
    ("POST", f"{API}/runs/{{run}}/workers"),  # registration: the run's join key guards it, if it has one
    ("GET", "/"),  # the dashboard page, meant to be shared
    ("GET", f"{API}/runs/{{run}}/dashboard"),  # its numbers: names and teams, never tokens or reasons
    ("GET", f"{API}/runs/{{run}}/progress"),  # the dashboard's too (coordinator/api/stats.py)
    ("GET", f"{API}/runs/{{run}}/stats/daily"),  # the contributors' stats: like the leaderboard
    ("GET", f"{API}/runs/{{run}}/stats/summary"),
    ("GET", f"{API}/runs/{{run}}/contributors/{{name:path}}/history"),
    ("GET", "/metrics"),  # Prometheus: aggregates per run, nothing the dashboard does not show
}

# Known today; the classifier must find at least these (a broken classifier must not test nothing).
KNOWN_WORKER = {
    ("POST", f"{API}/runs/{{run}}/leases"),
    ("POST", f"{API}/leases/{{lease_id}}/delta"),
    ("POST", f"{API}/leases/{{lease_id}}/exchange"),
    ("GET", f"{API}/runs/{{run}}/shards/{{shard}}"),
}
KNOWN_ADMIN = {
    ("POST", f"{API}/runs"),
    ("POST", f"{API}/runs/{{run}}/evaluate"),
}


# -- the classifier ---------------------------------------------------------------------------

def api_routes(app: fastapi.FastAPI) -> Iterator[tuple[str, str, object]]:
    """(METHOD, path, dependant) of every API route, included routers flattened."""
    # Newer FastAPI keeps an included router as one node of app.routes; iter_route_contexts walks them.
    iter_contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    routes = iter_contexts(app.routes) if iter_contexts is not None else app.routes
    for route in routes:
        if isinstance(getattr(route, "original_route", route), APIRoute):
            for method in sorted(route.methods):
                yield method, route.path, route.dependant


def dependency_calls(dependant) -> set[Callable]:
    """Every callable the dependant depends on, however deep."""
    return {dependant.call} | {call for sub in dependant.dependencies for call in dependency_calls(sub)}


def classify(app: fastapi.FastAPI) -> dict[str, set[tuple[str, str]]]:
    found: dict[str, set[tuple[str, str]]] = {"worker": set(), "admin": set(), "open": set()}
    for method, path, dependant in api_routes(app):
        calls = dependency_calls(dependant)
        if current_worker in calls:
            found["worker"].add((method, path))
        if require_admin in calls:
            found["admin"].add((method, path))
        if current_worker not in calls and require_admin not in calls:
            found["open"].add((method, path))
    return found


# Collection needs the routes before any fixture runs: an app that is never started gives them.
ROUTES = classify(create_app(CoordinatorSettings(data_dir=Path("unused"), admin_token=ADMIN_TOKEN),
                             start_merger=False))
WORKER_ROUTES = sorted(ROUTES["worker"], key=lambda r: (r[1], r[0]))
ADMIN_ROUTES = sorted(ROUTES["admin"], key=lambda r: (r[1], r[0]))


def test_classifier_finds_the_known_routes():
    assert KNOWN_WORKER <= ROUTES["worker"], KNOWN_WORKER - ROUTES["worker"]
    assert KNOWN_ADMIN <= ROUTES["admin"], KNOWN_ADMIN - ROUTES["admin"]
    assert not ROUTES["worker"] & ROUTES["admin"], "a route guarded for workers and operators at once"
    # the control: known open routes are not mistaken for guarded ones
    assert {("GET", "/healthz"), ("GET", f"{API}/runs")} <= ROUTES["open"]


def test_unguarded_routes_are_public():
    unexpected = ROUTES["open"] - PUBLIC
    assert not unexpected, (f"routes with neither CurrentWorker nor AdminDep: {sorted(unexpected)}; "
                            "guard them, or add them to PUBLIC if anyone may call them")


# -- the app ----------------------------------------------------------------------------------

def _run_config(name: str, corpus: Path) -> dict:
    return {"name": name, "corpus": str(corpus), "corpus_max_bytes": 1 << 18, "shard_tokens": 1024,
            "eval_tokens": 4096, "model": dict(TINY_MODEL), "inner": {"steps": 2, "batch_size": 2}}


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def env(tmp_path_factory, corpus_dir):
    """Runs "t" and "u"; on "t" a worker with a lease, a second worker with a lease, a revoked worker
    and a spare one (the {worker_id} of operator routes); on "u" a worker with a lease."""
    settings = CoordinatorSettings(data_dir=tmp_path_factory.mktemp("auth") / "coordinator", admin_token=ADMIN_TOKEN,
                                   corpus_dirs=[corpus_dir])
    with TestClient(create_app(settings, start_merger=False), base_url=BASE_URL) as client:
        for name in ("t", "u"):
            resp = client.post(f"{API}/runs", json=_run_config(name, corpus_dir), headers=_bearer(ADMIN_TOKEN))
            assert resp.status_code == 201, resp.text
        e = SimpleNamespace(client=client, corpus=corpus_dir, tokens={}, ids={}, leases={})
        for key, run in (("worker", "t"), ("neighbour", "t"), ("revoked", "t"), ("spare", "t"), ("other_run", "u")):
            resp = client.post(f"{API}/runs/{run}/workers", json={"name": key})
            assert resp.status_code == 201, resp.text
            e.tokens[key], e.ids[key] = resp.json()["token"], resp.json()["worker_id"]
            lease = client.post(f"{API}/runs/{run}/leases", headers=_bearer(e.tokens[key]))
            assert lease.status_code == 200, lease.text
            e.leases[key] = lease.json()["lease_id"]
        # no revoke route is assumed: the row is marked directly
        with Session(client.app.state.coordinator.db.engine) as s:
            s.get(Worker, e.ids["revoked"]).revoked = True
            s.commit()
        e.schema = client.app.openapi()
        yield e


def _request(env, method: str, path: str, headers: dict[str, str], *, lease_of: str = "worker"):
    """`method path` with real path parameters, valid required query parameters and a valid body."""
    op = env.schema["paths"][path][method.lower()]
    fill = {"run": "t", "lease_id": env.leases[lease_of], "shard": 0, "version": "latest",
            "worker_id": env.ids["spare"], "team": "lab", "from_version": 0, "to_version": 1, "copy": "0" * 64}
    path_params = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
    missing = path_params - set(fill)
    assert not missing, f"{method} {path}: teach _request a real value for {sorted(missing)}"
    url = path.format(**{name: fill[name] for name in path_params})
    query = {p["name"]: 1 if p.get("schema", {}).get("type") == "integer" else "x"
             for p in op.get("parameters", []) if p["in"] == "query" and p.get("required")}
    kwargs: dict = {"params": query, "headers": dict(headers)}
    content = op.get("requestBody", {}).get("content", {})
    if "application/octet-stream" in content:
        kwargs["content"] = b"not a delta"
        kwargs["headers"]["Content-Type"] = "application/octet-stream"
    elif "application/json" in content:
        # a valid RunConfig where one is asked for (a fresh name: the control may create it); else {}
        ref = content["application/json"].get("schema", {}).get("$ref", "")
        kwargs["json"] = _run_config(f"new-{len(env.tokens)}", env.corpus) if ref.endswith("/RunConfig") else {}
    return env.client.request(method, url, **kwargs)


def _ids(routes):
    return [f"{method} {path}" for method, path in routes]


# -- admin routes -----------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES, ids=_ids(ADMIN_ROUTES))
def test_admin_route_refuses_a_missing_or_wrong_token(env, method, path):
    missing = _request(env, method, path, {})
    assert missing.status_code == 401, missing.text
    assert missing.headers.get("www-authenticate") == "Bearer"
    not_bearer = _request(env, method, path, {"Authorization": f"Basic {ADMIN_TOKEN}"})
    assert not_bearer.status_code == 401, not_bearer.text
    for who, token in (("wrong", "x" * len(ADMIN_TOKEN)), ("prefix", ADMIN_TOKEN[:-1]),
                       ("worker", env.tokens["worker"])):
        resp = _request(env, method, path, _bearer(token))
        assert resp.status_code == 403, (who, resp.text)


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES, ids=_ids(ADMIN_ROUTES))
def test_admin_route_lets_the_admin_token_in(env, method, path):
    resp = _request(env, method, path, _bearer(ADMIN_TOKEN))
    assert resp.status_code not in (401, 403) and resp.status_code < 500, resp.text


# -- worker routes ----------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path"), WORKER_ROUTES, ids=_ids(WORKER_ROUTES))
def test_worker_route_refuses_a_missing_or_unknown_token(env, method, path):
    missing = _request(env, method, path, {})
    assert missing.status_code == 401, missing.text
    assert missing.headers.get("www-authenticate") == "Bearer"
    for who, headers in (("unknown", _bearer("u" * 43)), ("admin", _bearer(ADMIN_TOKEN)),
                         ("not bearer", {"Authorization": f"Basic {env.tokens['worker']}"})):
        resp = _request(env, method, path, headers)
        assert resp.status_code == 401, (who, resp.text)


@pytest.mark.parametrize(("method", "path"), WORKER_ROUTES, ids=_ids(WORKER_ROUTES))
def test_worker_route_refuses_a_revoked_token(env, method, path):
    resp = _request(env, method, path, _bearer(env.tokens["revoked"]), lease_of="revoked")
    assert resp.status_code == 403, resp.text
    assert "revoked" in resp.json()["detail"]


@pytest.mark.parametrize(("method", "path"), WORKER_ROUTES, ids=_ids(WORKER_ROUTES))
def test_worker_route_refuses_another_runs_or_workers_token(env, method, path):
    if "{run}" not in path and "{lease_id}" not in path:
        pytest.skip("names neither a run nor a lease: any live worker may call it")
    if "{run}" in path:  # run "t" in the path, a worker of "u"
        resp = _request(env, method, path, _bearer(env.tokens["other_run"]))
        assert resp.status_code == 403, ("other run", resp.text)
    if "{lease_id}" in path:  # the lease of "worker", another worker's token (same run, and another run)
        for who in ("neighbour", "other_run"):
            resp = _request(env, method, path, _bearer(env.tokens[who]))
            assert resp.status_code == 403, (who, resp.text)


@pytest.mark.parametrize(("method", "path"), WORKER_ROUTES, ids=_ids(WORKER_ROUTES))
def test_worker_route_lets_its_worker_in(env, method, path):
    resp = _request(env, method, path, _bearer(env.tokens["worker"]))
    assert resp.status_code not in (401, 403) and resp.status_code < 500, resp.text
