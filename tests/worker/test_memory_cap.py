"""--max-memory: a volunteer's own cap below what the machine holds (worker/memory.py): the limit it
sets, leases refused above it, and micro-batches picked to fit it."""

from __future__ import annotations

import logging

import pytest

from shared.config import InnerConfig
from shared.model import ModelConfig
from worker import memory
from worker.fit import pick_micro_batch
from worker.settings import WorkerSettings, describe_errors

GB = 10**9
BIG_MACHINE = memory.Memory(total_ram=64 * GB, available_ram=48 * GB)


def test_the_cap_gives_the_largest_limit_whose_round_budget_fits():
    for cap in (1 << 30, 6 * GB, 6 * (1 << 30), 12_345_678_901):
        m = memory.params_within(cap)
        assert memory.budget_bytes(m) <= cap < memory.budget_bytes(m + 1)


def test_the_cap_lowers_the_memory_default_and_an_explicit_max_params(caplog):
    probe = lambda: BIG_MACHINE  # noqa: E731
    default = memory.default_max_params(BIG_MACHINE)
    with caplog.at_level(logging.INFO, logger="worker.memory"):
        capped = memory.worker_max_params(None, 6 * GB, probe)
    assert capped == memory.params_within(6 * GB) < default
    assert "--max-memory 6.0 GB" in caplog.text
    assert memory.worker_max_params(None, None, probe) == default
    assert memory.worker_max_params(500_000_000, 6 * GB, probe) == memory.params_within(6 * GB)
    assert memory.worker_max_params(1_000_000, 6 * GB, probe) == 1_000_000  # the lower of the two wins


def test_a_cap_above_what_the_machine_holds_changes_nothing():
    small = memory.Memory(total_ram=8 * GB, available_ram=4 * GB)
    assert memory.worker_max_params(None, 64 * GB, lambda: small) == memory.default_max_params(small)


def test_leases_above_the_cap_are_refused_and_micro_batches_fit_it():
    cfg = ModelConfig(n_layer=12, n_head=12, d_model=768, context=1024)  # 124M parameters
    limit = memory.params_within(6 * GB)
    assert memory.lease_too_big(cfg, batch_size=1, max_params=limit) is None
    assert "--max-memory" in memory.lease_too_big(cfg, batch_size=1, max_params=memory.params_within(2 * GB))
    inner = InnerConfig(batch_size=64)
    rows = pick_micro_batch(cfg, inner, max_params=limit)
    assert rows is not None and rows < 64  # the whole batch at once would not fit 6 GB...
    assert memory.round_bytes(cfg.n_params(), cfg, batch_size=rows) <= 6 * GB  # ...its micro-batches do
    assert pick_micro_batch(cfg, inner, max_params=memory.params_within(200 * GB)) is None


@pytest.mark.parametrize("value, bytes_", [("6GB", 6 * GB), ("8GiB", 8 << 30), ("1.5 gb", 1_500_000_000),
                                           (4_000_000_000, 4_000_000_000)])
def test_the_setting_reads_sizes(value, bytes_):
    assert WorkerSettings(coordinator="http://127.0.0.1:1", run="r", max_memory=value).max_memory == bytes_


@pytest.mark.parametrize("value, says", [("6XB", "'6XB' is not a size"), ("lots", "'lots' is not a size"),
                                         ("512MB", "below the least a round needs, 1GiB")])
def test_bad_sizes_are_clear(value, says):
    with pytest.raises(ValueError) as info:
        WorkerSettings(coordinator="http://127.0.0.1:1", run="r", max_memory=value)
    assert says in describe_errors(info.value) and "max_memory" in describe_errors(info.value)
