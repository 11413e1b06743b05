"""A worker following the whole coordinator (worker/project.py): which run it picks, and when it
moves on; the loopback test (tests/e2e/test_lifecycle.py) runs it against a real coordinator."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from shared import protocol
from worker.project import Candidate, Project, follows_project, pick
from worker.settings import WorkerSettings

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TINY = {"name": "x", "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "context": 32},
        "inner": {"steps": 3, "batch_size": 4}}


def _run(name: str, priority: int = 0, *, age: int = 0, state: str = "active", n_params: int = 1000,
         join_key: bool = False) -> protocol.RunSummary:
    return protocol.RunSummary(name=name, state=state, version=0, created_at=T0 + timedelta(minutes=age),
                               priority=priority, n_params=n_params, join_key_required=join_key)


def _fits(run):
    return None if run.n_params <= 5000 else "too large"


def test_the_highest_priority_run_it_can_train_wins():
    runs = [_run("low", 1), _run("big", 9, n_params=10**6), _run("keyed", 8, join_key=True), _run("mid", 5),
            _run("paused", 10, state="paused"), _run("twin", 5, age=1)]
    choice, passed = pick(runs, fits=_fits, has_join_key=False, skip={})
    assert choice == Candidate("mid", 5)  # the older of the two at priority 5
    assert passed == ["run big (priority 9): too large", "run keyed (priority 8): it needs a join key (--join-key)"]
    assert pick(runs, fits=_fits, has_join_key=True, skip={})[0] == Candidate("keyed", 8)
    skipped, _ = pick(runs, fits=_fits, has_join_key=False, skip={"mid": "it answered HTTP 410: finished"})
    assert skipped == Candidate("twin", 5)
    assert pick([_run("big", n_params=10**6)], fits=_fits, has_join_key=False, skip={})[0] is None


def test_no_run_or_auto_follows_the_coordinator(tmp_path):
    assert follows_project(WorkerSettings(coordinator="http://127.0.0.1:9", state_dir=tmp_path))
    assert follows_project(WorkerSettings(coordinator="http://127.0.0.1:9", run="auto", state_dir=tmp_path))
    assert not follows_project(WorkerSettings(coordinator="http://127.0.0.1:9", run="r", state_dir=tmp_path))


class _Lister:
    def __init__(self, runs, config):
        self.listed, self.runs_now, self.config = 0, runs, config

    def runs(self, *, state):
        self.listed += 1
        return self.runs_now

    def run_config(self, name):
        return {**self.config, "name": name}


def _project(tmp_path, lister, max_params=10**6) -> Project:
    settings = WorkerSettings(coordinator="http://127.0.0.1:9", state_dir=tmp_path)
    return Project(settings, stop=None, client=lister, max_params=max_params)


GPT2ISH = {"shard_tokens": 1 << 20, "model": {"n_layer": 12, "d_model": 768, "n_head": 2, "context": 2048},
           "inner": {"steps": 3, "batch_size": 4}}  # 86,825,472 parameters; a round needs --max-params 105,732,700


def test_a_round_must_fit_the_machine_not_only_the_parameters(tmp_path):
    project = _project(tmp_path, _Lister([], GPT2ISH), max_params=100_000_000)
    why_not = project.fits(_run("a", n_params=86_825_472))  # the parameters fit, a round's activations do not
    assert why_not == "a round needs --max-params >= 105,732,700, this worker has 100,000,000"
    assert "over this worker's --max-params" in project.fits(_run("b", n_params=200_000_000))
    assert _project(tmp_path, _Lister([], GPT2ISH), max_params=110_000_000).fits(_run("a", n_params=86_825_472)) is None


def test_it_moves_on_when_a_better_run_comes_and_passes_over_a_finished_one(tmp_path, monkeypatch):
    lister = _Lister([_run("a", 1)], TINY)
    project = _project(tmp_path, lister)
    current = project.choose()
    assert current == Candidate("a", 1)
    leave = project.better_than(current)
    assert not leave() and lister.listed == 1  # not due yet: no request
    monkeypatch.setattr(Project, "RECHECK_S", 0.0)
    leave = project.better_than(current)
    assert not leave()  # due, but still the best
    lister.runs_now = [_run("a", 1), _run("b", 3)]
    assert leave()
    project.left("b", _gone())
    assert project.choose() == Candidate("a", 1)  # b finished: passed over


def _gone():
    from worker.client import RunUnavailable

    return RunUnavailable(410, "run 'b' finished", run="b")


def test_a_follower_lists_an_older_coordinators_runs_in_its_version(tmp_path, monkeypatch):
    """Against a coordinator serving only API v2 the follower's requests say v2 (a v3 header would
    be answered 426 there), from its /healthz on."""
    import httpx

    from worker import project as project_mod
    from worker.control import StopFlag

    stop, seen = StopFlag(), []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers[protocol.H_API_VERSION]))
        if request.url.path == "/healthz":
            return httpx.Response(200, json={"status": "ok", "api_version": 2, "min_api_version": 2})
        stop.event.set()  # the runs listed: enough
        return httpx.Response(200, json=[])

    real = project_mod.CoordinatorClient
    monkeypatch.setattr(project_mod, "CoordinatorClient",
                        lambda *a, **kw: real(*a, transport=httpx.MockTransport(handler), **kw))
    settings = WorkerSettings(coordinator="http://coordinator.test", state_dir=tmp_path, max_params=10**6)
    assert project_mod.follow(settings, stop=stop) == 0
    assert seen == [("/healthz", str(protocol.API_VERSION)), (f"{protocol.API_PREFIX}/runs", "2")]
