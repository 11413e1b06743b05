"""Shared by the worker tests."""

from __future__ import annotations

import pytest

from worker import connection, downloads, loop


def no_backoff(monkeypatch) -> None:
    """The worker's backoff waits (the loop's, the connection's, the shard downloads') take no time."""
    for mod in (loop, connection, downloads):
        monkeypatch.setattr(mod, "backoff_delay", lambda attempt: 0.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """These models are tiny: every worker test trains in one torch thread (tests/conftest.py)."""


# The worker tests reach the in-process coordinator as http://coordinator.test (a name that is plainly
# not a real host): the coordinator is told it answers to it, as an operator behind a public name would.
WORKER_TEST_HOST = "coordinator.test"


@pytest.fixture
def settings(settings):
    return settings.model_copy(update={"allowed_hosts": [WORKER_TEST_HOST]})
