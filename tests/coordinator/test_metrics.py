"""GET /metrics: the Prometheus text format, parsed back and checked against what happened."""

from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.api.metrics import AppMetrics
from coordinator.runtime import MergeOutcome, RunRuntime
from coordinator.settings import CoordinatorSettings
from coordinator.storage import Storage
from shared.algorithms.robust import Rejection, screen
from shared.codec import Delta, Entry, IndexKind, ValueKind
from shared.config import RobustConfig
from tests.conftest import API, schema_of


def scrape(api) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    resp = api.client.get("/metrics")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_count_merges_rejections_leases_bytes_and_loss(api, run, make_delta, encode_unchecked):
    ws = [api.register(name=f"w{i}", team="blue") for i in range(4)]
    leases = [api.lease(w) for w in ws]
    snapshot = api.snapshot()  # counted as model bytes out
    for i in (0, 1):
        api.accept(leases[i].lease_id, make_delta(leases[i], seed=i), ws[i])
    huge = encode_unchecked(leases[2].base_version,  # far past the AdamW bound: rejected at merge
                            [(n, [1e3] * math.prod(shape)) for n, shape in schema_of(leases[2]).items()])
    api.accept(leases[2].lease_id, huge, ws[2])
    assert api.upload(leases[3].lease_id, b"not a delta", ws[3]).status_code == 422  # refused at upload

    before = scrape(api)
    assert value(before, "idletrain_deltas_queued", run="t") == 3
    assert value(before, "idletrain_merge_seconds_count", run="t") == 0  # known runs are exported from the start
    assert api.drain() == 3
    api.operator("post", f"{API}/runs/t/evaluate")

    m = scrape(api)
    status = api.status()
    assert value(m, "idletrain_model_version", run="t") == 3
    assert value(m, "idletrain_deltas_merged_total", run="t") == 2
    assert value(m, "idletrain_deltas_rejected_total", run="t", stage="merge") == 1
    assert value(m, "idletrain_deltas_rejected_total", run="t", stage="upload") == 1
    assert value(m, "idletrain_deltas_queued", run="t") == 0
    for reason in Rejection:  # bounded labels, every one present
        assert value(m, "idletrain_merge_rejections_total", run="t", reason=reason.value) == (reason == "bound")
    assert value(m, "idletrain_merge_seconds_count", run="t") == 3
    assert 0 < value(m, "idletrain_merge_seconds_sum", run="t") < 60
    assert value(m, "idletrain_merge_seconds_bucket", run="t", le="+Inf") == 3
    assert value(m, "idletrain_leases", run="t", state="delivered") == 3
    assert value(m, "idletrain_leases", run="t", state="active") == 1
    assert value(m, "idletrain_leases", run="t", state="expired") == 0
    assert value(m, "idletrain_tokens_trained_total", run="t") == status["tokens_trained"]
    assert value(m, "idletrain_bytes_in_total", run="t") == status["bytes_up"] > len(b"not a delta")
    assert value(m, "idletrain_bytes_out_total", run="t", kind="model") == len(snapshot)
    assert value(m, "idletrain_bytes_out_total", run="t", kind="data") == 0
    assert value(m, "idletrain_dense_equivalent_bytes_total", run="t") == status["dense_equivalent_bytes"]
    assert value(m, "idletrain_eval_loss", run="t") == pytest.approx(status["eval_loss"])
    assert value(m, "idletrain_workers", run="t", state="registered") == 4
    assert value(m, "idletrain_workers", run="t", state="live") == 4
    tokens = run.inner.steps * run.inner.batch_size * run.model.context
    assert 2 * tokens <= value(m, "idletrain_credit_total", run="t") <= 2 * tokens * 4


def test_each_app_has_its_own_registry(tmp_path, open_api, run_config, make_delta):
    # b on a database of its own (a gets the test's): what the registries hold must not mix
    b_db = f"sqlite:///{tmp_path / 'b.sqlite3'}"
    with open_api(CoordinatorSettings(data_dir=tmp_path / "a")) as a, \
            open_api(CoordinatorSettings(data_dir=tmp_path / "b", database_url=b_db)) as b:
        a.create_run(run_config("one"))
        b.create_run(run_config("two"))
        w = a.register("one")
        lease = a.lease(w, run="one")
        a.accept(lease.lease_id, make_delta(lease), w)
        a.drain()
        ma, mb = scrape(a), scrape(b)
    assert value(ma, "idletrain_merge_seconds_count", run="one") == 1
    assert not any(labels and dict(labels).get("run") == "two" for _, labels in ma)
    assert value(mb, "idletrain_model_version", run="two") == 0
    assert ("idletrain_merge_seconds_count", (("run", "one"),)) not in mb
    assert b"idletrain_" not in generate_latest(REGISTRY)  # nothing leaks into the global default registry


def test_metrics_without_runs(api):
    assert scrape(api) == {}


def _dense(values) -> Delta:
    v = np.asarray(values, dtype=np.float32)
    return Delta(0, (Entry("w", v.size, IndexKind.DENSE, ValueKind.FP32, v),))


def _merge_rejections(seq: int, base_version: int, tmp_path) -> Rejection | None:
    """What a fresh tiny run's merge of stored delta `seq` (none stored: unreadable) is rejected as."""
    from tests.coordinator.test_runtime_merge import config

    rt = RunRuntime.fresh(run_id=1, config=config(max_staleness=1), storage=Storage.local(tmp_path))
    rt.version = seq - 1
    return rt.merge(seq=seq, base_version=base_version, write_snapshot=False).rejection


def test_rejection_classes_are_set_where_each_rejection_is_decided(tmp_path):
    """The merger's rejections carry their class (robust.Rejection, the metrics' label) from where they
    are decided: the screen's verdicts and the runtime's own; no free text is matched."""
    import torch

    cfg = RobustConfig(min_history=4, window=8)
    history = [1.0, 1.0, 1.0, 1.0]
    classes = {
        "nonfinite": screen(_dense([math.inf, 0]), history=[], reference=None, cfg=cfg).rejection,
        "bound": screen(_dense([100.0, 0]), history=[], reference=None, cfg=cfg, bound=1.0).rejection,
        "idle": screen(_dense([0.0, 0]), history=[], reference=None, cfg=cfg).rejection,
        "small": screen(_dense([1e-3, 0]), history=[1.0] * 4, reference=None,
                        cfg=cfg.model_copy(update={"min_workers": 1})).rejection,
        "norm": screen(_dense([50.0, 0]), history=history, reference=None, cfg=cfg).rejection,
        "direction": screen(_dense([-1.0, 0]), history=history, reference={"w": torch.tensor([1.0, 0.0])},
                            cfg=cfg).rejection,
        # coordinator/runtime.py's own: 2 versions stale (limit 1), and a delta with no stored bytes
        "stale": _merge_rejections(5, 2, tmp_path / "stale"),
        "unreadable": _merge_rejections(5, 4, tmp_path / "unreadable"),
    }
    for label, why in classes.items():
        assert why == label and why.value == label, (label, why)
    # the screen's other rejections fall in the same classes
    assert screen(_dense([100.0, 0]), history=[], reference=None, cfg=cfg, elements=1.0).rejection == "bound"
    assert screen(_dense([100.0, 0]), history=[], reference=None, cfg=cfg, reference_norm=1.0).rejection == "bound"
    assert screen(_dense([1e-9, 0]), history=[], reference=None, cfg=cfg, reference_norm=1.0).rejection == "idle"
    assert screen(_dense([1e-3, 0]), history=[1.0] * 4, reference=None,
                  cfg=cfg.model_copy(update={"min_workers": 1})).rejection == "small"
    assert screen(_dense([0, 2.0]), history=history, reference={"w": torch.tensor([1.0, 0.0])},
                  cfg=cfg.model_copy(update={"min_workers": 1})).rejection == "direction"
    assert _merge_rejections(5, 9, tmp_path / "newer") == "stale"  # a base version newer than the model
    # a rejection without a class (none is decided that way today) is counted as "other"
    metrics = AppMetrics(None)
    rt = type("Rt", (), {"config": type("Cfg", (), {"name": "r"})()})()
    metrics.observe_merge(rt, MergeOutcome(1, False, 0, 1.0, "something new", "", 0), 0.01)
    (family,) = metrics.merge_rejections.collect()
    assert {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}["other"] == 1
    assert set(classes) | {"other"} == {r.value for r in Rejection}
