"""An API fuzz run: schemathesis against the app's own OpenAPI schema, in process, bounded in time.

The schema is loaded from the live app (schemathesis.openapi.from_asgi); schemathesis starts the
app's lifespan once for the module and sends every request in process. One pytest item per
operation, so a route added later is fuzzed without editing this file. Each item gets
MAX_EXAMPLES cases, positive (valid per the schema) and negative (invalid) alike.

The app holds real objects, so generated requests get past the 404s and 401s:

    run "t" (diloco) and run "u" (sparta+diloco): tiny models, 190 shards each
    per operation, fresh: a worker of each run with an active lease, a revoked worker of "t"
    and a spare worker of "t" (the one operator routes on {worker_id} may draw)
    an admin token in the settings; per-worker rate limits off (a 429 would hide what lies behind)

Every case also draws which of those it uses: `run`, `lease_id`, `shard`, `version` and
`worker_id` in the path sometimes become real ones, and the Authorization header is one of:
as generated / none / a worker's / another run's worker's / a revoked worker's / the admin's /
garbage. A generated RunConfig is kept cheap (the small test corpus, a capped model).

Checks: no answer is a 5xx (not_a_server_error), and 2xx answers conform to the schema (body and
content type). 4xx answers are not held to the schema: the service's own 422s say
{"detail": "<text>"} where the schema documents FastAPI's {"detail": [<validation error>...]},
and 401/403/404/409/410/413 are not documented at all.

Reproducible: hypothesis derandomize=True and no example database (the operations run in a fixed
order against one app). IDLETRAIN_FUZZ_EXAMPLES=200 makes a longer hunt (about 1.5 min on 2 cores).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import fastapi.routing
import pytest
from fastapi.routing import APIRoute
from sqlalchemy.orm import Session
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

with warnings.catch_warnings():  # schemathesis imports starlette's test client, which nags about httpx
    warnings.simplefilter("ignore")
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.python import asgi as schemathesis_asgi
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
    )

from coordinator.api.deps import current_worker, require_admin
from coordinator.app import create_app
from coordinator.models import Worker
from coordinator.settings import CoordinatorSettings
from shared import protocol
from tests.conftest import TINY_MODEL, write_corpus

API = protocol.API_PREFIX
ADMIN_TOKEN = "fuzz-admin-token-0123456789"
MAX_EXAMPLES = int(os.environ.get("IDLETRAIN_FUZZ_EXAMPLES", "30"))  # raise it for a longer hunt
RUNS = {"t": "diloco", "u": "sparta+diloco"}

# Upper bounds put on a generated RunConfig.model, so a created run stays tiny (the schema bounds none).
MODEL_CAPS = {"n_layer": 2, "n_head": 8, "d_model": 64, "context": 64, "vocab_size": 512}

# The Authorization header a case may carry, by what the route asks for. Hypothesis draws a sampled
# list's first entries most often, so the token that gets past the route's guard comes first.
AUTH_CHOICES = {
    "worker": ("worker", "other_run_worker", "revoked", "admin", "garbage", "none", "generated"),
    "admin": ("admin", "worker", "garbage", "none", "generated"),
    "open": ("generated", "none", "worker", "admin"),
}


def _run_config(name: str, algorithm: str, corpus: Path) -> dict:
    return {"name": name, "algorithm": algorithm, "corpus": str(corpus), "corpus_max_bytes": 1 << 18,
            "shard_tokens": 1024, "eval_tokens": 4096, "model": dict(TINY_MODEL),
            "inner": {"steps": 2, "batch_size": 2}, "outer": {"group": 2}, "sparta": {"p": 0.1, "every": 1},
            "epochs": 0}  # shards come round again: the fuzzed requests take many leases


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory, corpus_dir):
    no_limits = {k: 0 for k in ("lease_rate", "upload_rate", "exchange_rate", "register_rate")
                 if k in CoordinatorSettings.model_fields}
    # 190 shards a run: every operation's fresh workers take leases, and earlier ones keep theirs
    corpus = write_corpus(tmp_path_factory.mktemp("fuzz-corpus"), n_files=200)
    # schemathesis' in-process client asks for Host "testserver"
    settings_ = CoordinatorSettings(data_dir=tmp_path_factory.mktemp("fuzz") / "coordinator",
                                    admin_token=ADMIN_TOKEN, corpus_dirs=[corpus, corpus_dir], allowed_hosts=["testserver"],
                                    **no_limits)
    app = create_app(settings_, start_merger=False)
    # schemathesis' in-process client: entering it starts the app's lifespan, kept until shutdown_lifespans
    with schemathesis_asgi.get_client(app) as client:
        for name, algorithm in RUNS.items():
            resp = client.post(f"{API}/runs", json=_run_config(name, algorithm, corpus), headers=_bearer(ADMIN_TOKEN))
            assert resp.status_code == 201, resp.text
    app.state.fuzz_corpus = corpus
    try:
        yield app
    finally:
        schemathesis_asgi.shutdown_lifespans()


@pytest.fixture(scope="module")
def api_schema(fuzz_app):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)


@dataclass
class Targets:
    """What a fuzzed request may point at: real names, ids and tokens."""

    corpus: str
    tokens: dict[str, str] = field(default_factory=dict)  # auth choice -> bearer token
    leases: list[int] = field(default_factory=list)
    worker_ids: list[int] = field(default_factory=list)


@pytest.fixture
def targets(fuzz_app, corpus_dir) -> Targets:
    """Fresh workers and leases for each operation: what the previous one did to its own (took a
    newer lease, revoked it, paused its run) does not hide the next one's paths."""
    tg = Targets(corpus=str(corpus_dir), tokens={"admin": ADMIN_TOKEN, "garbage": "x" * 43})
    with schemathesis_asgi.get_client(fuzz_app) as client:
        for run in RUNS:
            # a fuzzed finish, archive or delete ends a run for good: such a run is made again
            got = client.get(f"{API}/runs/{run}/status")
            if got.status_code == 404 or got.json().get("state") in ("finishing", "finished", "archived"):
                _remake(client, fuzz_app, run, exists=got.status_code != 404)
            client.post(f"{API}/runs/{run}/resume", headers=_bearer(ADMIN_TOKEN))  # a fuzzed pause
            # a fuzzed PATCH may have set a budget its leases out already spend (204 to every lease request)
            reset = client.patch(f"{API}/runs/{run}", json={"token_budget": None, "epochs": 0},
                                 headers=_bearer(ADMIN_TOKEN))
            assert reset.status_code == 200, reset.text
        for key, run in (("worker", "t"), ("other_run_worker", "u"), ("revoked", "t"), ("spare", "t")):
            # the module's app lives on: a name is claimed once per run, then joined with its key
            resp = client.post(f"{API}/runs/{run}/workers", json={"name": key, "contributor_key": f"fuzz-{key}"})
            assert resp.status_code == 201, resp.text
            tg.tokens[key] = resp.json()["token"]
            if key in ("worker", "other_run_worker"):
                lease = client.post(f"{API}/runs/{run}/leases", headers=_bearer(tg.tokens[key]))
                if lease.status_code == 204:  # every shard held by earlier operations' leases: a fresh run
                    _remake(client, fuzz_app, run, exists=True)
                    resp = client.post(f"{API}/runs/{run}/workers", json={"name": key, "contributor_key": f"fuzz-{key}"})
                    tg.tokens[key] = resp.json()["token"]
                    lease = client.post(f"{API}/runs/{run}/leases", headers=_bearer(tg.tokens[key]))
                assert lease.status_code == 200, lease.text
                tg.leases.append(lease.json()["lease_id"])
            if key == "spare":
                tg.worker_ids.append(resp.json()["worker_id"])
            if key == "revoked":
                worker_id = resp.json()["worker_id"]
                with Session(fuzz_app.state.coordinator.db.engine) as s:
                    s.get(Worker, worker_id).revoked = True
                    s.commit()
    return tg


def _remake(client, app, run: str, *, exists: bool) -> None:
    """The run made again from its config: a fuzzed finish, archive or delete ended it for good."""
    if exists:
        gone = client.delete(f"{API}/runs/{run}", params={"force": "true"}, headers=_bearer(ADMIN_TOKEN))
        assert gone.status_code == 200, gone.text
    made = client.post(f"{API}/runs", json=_run_config(run, RUNS[run], app.state.fuzz_corpus),
                       headers=_bearer(ADMIN_TOKEN))
    assert made.status_code == 201, made.text


def _operations() -> list[tuple[str, str]]:
    """(METHOD, path) of every operation, from an app that is never started: collection needs them
    before any fixture runs, and routes added later are picked up by themselves."""
    paths = create_app(CoordinatorSettings(data_dir=Path("unused")), start_merger=False).openapi()["paths"]
    return sorted((method.upper(), path) for path, ops in paths.items() for method in ops)


def _guard(app, method: str, path: str) -> str:
    """"worker", "admin" or "open": what the route behind (method, path) depends on."""
    def calls(dependant) -> set:
        return {dependant.call} | {c for d in dependant.dependencies for c in calls(d)}

    # FastAPI >= 0.16x keeps included routers as nodes of app.routes; iter_route_contexts flattens them
    iter_contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    routes = iter_contexts(app.routes) if iter_contexts else app.routes
    for route in routes:
        if isinstance(getattr(route, "original_route", route), APIRoute) and route.path == path \
                and method in route.methods:
            found = calls(route.dependant)
            return "worker" if current_worker in found else "admin" if require_admin in found else "open"
    return "open"


def _tame_run_config(body: dict, corpus: str) -> None:
    """Keep a generated RunConfig cheap: the test corpus (never the builtin one or a random folder)
    and a capped model; shards small enough that a valid config does create a run."""
    if isinstance(body.get("corpus", ""), str):
        body["corpus"] = corpus
    body.setdefault("shard_tokens", 1024)
    model = body.setdefault("model", dict(TINY_MODEL))
    if isinstance(model, dict):
        for key, cap in MODEL_CAPS.items():
            value = model.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                model[key] = cap


@pytest.mark.parametrize(("method", "path"), _operations(), ids=lambda v: v)
def test_no_server_errors(fuzz_app, api_schema, targets: Targets, method: str, path: str):
    operation = api_schema[path][method]
    guard = _guard(fuzz_app, method, path)
    cases = st.one_of(operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
                      operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases, data=st.data())
    def fuzz(case, data):
        params = case.path_parameters if case.path_parameters is not None else {}
        # a real one first (drawn most often), then the generated one, then another real one
        real = {"run": list(RUNS), "lease_id": targets.leases, "shard": [0, 1], "version": ["latest", "0"],
                "worker_id": targets.worker_ids}
        for name, values in real.items():
            if name in params:
                params[name] = data.draw(st.sampled_from([*values[:1], params[name], *values[1:]]), label=name)
        if method == "POST" and path == f"{API}/runs" and isinstance(case.body, dict):
            _tame_run_config(case.body, targets.corpus)

        auth = data.draw(st.sampled_from(AUTH_CHOICES[guard]), label="auth")
        if auth != "generated":
            headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
            if auth != "none":
                headers.update(_bearer(targets.tokens[auth]))
            case.headers = headers

        response = case.call()
        checks = [not_a_server_error]
        if 200 <= response.status_code < 300:
            checks += [response_schema_conformance, content_type_conformance]
        case.validate_response(response, checks=checks)

    fuzz()


@pytest.mark.parametrize("value", [2**31, 2**64, -(2**64)], ids=["2^31", "2^64", "-2^64"])
def test_out_of_range_integers_in_the_path_are_refused(fuzz_app, targets: Targets, value: int):
    """Regression (found by the fuzz run): an integer path parameter past what the database holds
    was a 500 (OverflowError from SQLite). Every route's integer path parameters, with the token its
    guard wants and real values elsewhere in the path, must be refused with a 4xx."""
    schema = fuzz_app.openapi()
    real = {"run": "t", "version": "latest", "lease_id": targets.leases[0], "shard": 0,
            "worker_id": targets.worker_ids[0]}
    tried = 0
    with schemathesis_asgi.get_client(fuzz_app) as client:
        for path, ops in schema["paths"].items():
            for method, op in ops.items():
                params = [p for p in op.get("parameters", []) if p["in"] == "path"]
                for param in params:
                    if param["schema"].get("type") != "integer":
                        continue
                    filled = {p["name"]: value if p is param else real.get(p["name"], 1) for p in params}
                    url = path.format(**filled)
                    guard = _guard(fuzz_app, method.upper(), path)
                    token = {"worker": targets.tokens["worker"], "admin": ADMIN_TOKEN}.get(guard)
                    headers = {"Content-Type": "application/octet-stream", **(_bearer(token) if token else {})}
                    query = {p["name"]: 1 for p in op.get("parameters", []) if p["in"] == "query" and p.get("required")}
                    resp = client.request(method.upper(), url, headers=headers, params=query, data=b"x")
                    assert resp.status_code < 500, (method.upper(), url, resp.status_code, resp.text)
                    tried += 1
    assert tried >= 3  # lease_id twice, shard
