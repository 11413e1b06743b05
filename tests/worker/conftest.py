"""Shared by the worker tests."""

from __future__ import annotations

import pytest
import torch

from worker import connection, downloads, loop


def no_backoff(monkeypatch) -> None:
    """The worker's backoff waits (the loop's, the connection's, the shard downloads') take no time."""
    for mod in (loop, connection, downloads):
        monkeypatch.setattr(mod, "backoff_delay", lambda attempt: 0.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one torch thread beats two on a shared 2-core machine by far."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The worker tests reach the in-process coordinator as http://coordinator.test (a name that is plainly
# not a real host): the coordinator is told it answers to it, as an operator behind a public name would.
WORKER_TEST_HOST = "coordinator.test"


@pytest.fixture
def settings(settings):
    return settings.model_copy(update={"allowed_hosts": [WORKER_TEST_HOST]})
