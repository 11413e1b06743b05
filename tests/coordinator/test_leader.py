"""The merger lock between coordinator processes (coordinator/leader.py, app.py's Election, api/relay.py).

Two apps on one PostgreSQL schema and one data directory stand for two processes: the first leads,
the second relays what needs the live model, and takes over when the first goes away."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import update

from coordinator import leader
from coordinator.api.relay import RELAYED
from coordinator.models import Run
from coordinator.settings import CoordinatorSettings
from shared import codec, protocol
from tests.conftest import API, BASE_URL, Api, TestClient, create_app, fresh_database
from tests.coordinator.test_exchange import SPARTA, post_exchange, sent_for, worker_values

OWN_DB_BACKENDS = True


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_database("postgresql") as url:
        yield url


@pytest.fixture
def open_api(corpus_dir):
    @contextlib.contextmanager
    def _open(settings: CoordinatorSettings) -> Iterator[Api]:
        settings = settings.model_copy(update={"corpus_dirs": [corpus_dir]})
        with TestClient(create_app(settings, start_merger=False), base_url=BASE_URL) as client:
            yield Api(client)

    return _open


def _wait(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_one_process_leads_the_other_relays_and_takes_over(open_api, tmp_path: Path, pg_url: str, run_config):
    settings = CoordinatorSettings(data_dir=tmp_path / "coordinator", database_url=pg_url, relay=True,
                                   leader_poll_s=0.1)
    with contextlib.ExitStack() as first_ctx:
        first = first_ctx.enter_context(open_api(settings))
        with open_api(settings) as second:
            assert first.coordinator.live.leads and not second.coordinator.live.leads
            assert second.coordinator.live.runtime_list() == []  # no live models outside the leader
            first_url = leader.read(settings.data_dir)["url"]
            assert first_url.startswith("http://127.0.0.1:")

            # a run created through the follower: the leader loads it, the follower never does
            second.create_run(run_config(algorithm="sparta", sparta=SPARTA))
            _wait(lambda: len(first.coordinator.live.runtime_list()) == 1)
            assert second.coordinator.live.runtime_list() == []

            # a lease and an exchange through the follower: relayed, answered by the leader
            headers = second.register()
            lease = second.lease(headers)
            sent = sent_for(lease, SPARTA["every"], worker_values(first, "t"))
            before = first.runtime().state.params[sent.entries[0].name].clone()
            resp = post_exchange(second, lease.lease_id, SPARTA["every"], codec.encode(sent), headers)
            assert resp.status_code == 200, resp.text
            assert resp.headers[protocol.H_SHA256]
            codec.decode(resp.content, schema=first.runtime().schema)
            assert not torch.equal(first.runtime().state.params[sent.entries[0].name], before)  # the centre moved
            again = post_exchange(second, lease.lease_id, SPARTA["every"], codec.encode(sent), headers)
            assert again.status_code == 409, again.text  # refusals come back as they are

            # an evaluation through the follower runs on the leader's model
            ev = second.operator("post", f"{API}/runs/t/evaluate")
            assert ev.status_code == 200, ev.text

            # a relayed request that reaches a process which does not lead is never relayed again
            loop = post_exchange(second, lease.lease_id, 2 * SPARTA["every"], codec.encode(sent),
                                 {**headers, RELAYED: "1"})
            assert loop.status_code == 503 and loop.headers["Retry-After"], loop.text

            # deltas go to any process; the leader merges them
            body = codec.encode(codec.Delta(base_version=lease.base_version, entries=()))
            assert second.upload(lease.lease_id, body, headers).status_code == 202
            assert first.drain() == 1 and second.drain() == 0

            # the leader goes away: the follower takes the lock, loads the run, answers itself
            first_ctx.close()
            _wait(lambda: second.coordinator.live.leads)
            assert [rt.config.name for rt in second.coordinator.live.runtime_list()] == ["t"]
            assert second.runtime().version == 1
            headers2 = second.register()
            lease2 = second.lease(headers2)
            sent2 = sent_for(lease2, SPARTA["every"], worker_values(second, "t"))
            resp = post_exchange(second, lease2.lease_id, SPARTA["every"], codec.encode(sent2), headers2)
            assert resp.status_code == 200, resp.text
            assert leader.read(settings.data_dir)["url"] != first_url


def test_a_merge_is_fenced_by_the_version_it_followed(open_api, tmp_path: Path, pg_url: str, run_config,
                                                       make_delta):
    """A process that lost the lock without knowing it cannot merge: the version moved under it."""
    settings = CoordinatorSettings(data_dir=tmp_path / "coordinator", database_url=pg_url)
    with open_api(settings) as api:
        api.create_run(run_config())
        headers = api.register()
        lease = api.lease(headers)
        api.accept(lease.lease_id, make_delta(lease), headers)
        with api.db() as s:  # as if another process had merged version 1 already
            s.execute(update(Run).values(version=1))
            s.commit()
        with pytest.raises(RuntimeError, match="another coordinator process merged it"):
            api.drain()


def test_sqlite_has_one_process_and_it_leads(tmp_path: Path, open_api):
    with open_api(CoordinatorSettings(data_dir=tmp_path / "c")) as api:
        assert api.coordinator.live.leads and api.coordinator.live.leadership.held
        assert leader.read(tmp_path / "c") is None  # nothing to relay to without relay=True
