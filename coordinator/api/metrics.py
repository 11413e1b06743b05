"""GET /metrics in the Prometheus text format, from a registry of the app's own (never the global one,
so several apps in one process do not collide).

Read from the database at scrape time (they survive restarts and count every process's work):

    idletrain_model_version{run}                       gauge    deltas processed
    idletrain_deltas_merged_total{run}                 counter  merges
    idletrain_deltas_rejected_total{run,stage}         counter  stage: merge (robust merging, staleness) | upload
    idletrain_deltas_queued{run}                       gauge    acknowledged, not merged yet
    idletrain_leases{run,state}                        gauge    active | expired | delivered | abandoned
    idletrain_tokens_trained_total{run}                counter
    idletrain_bytes_in_total{run}                      counter  deltas and exchanges received
    idletrain_bytes_out_total{run,kind}                counter  kind: model (snapshots, corrections) | data
    idletrain_dense_equivalent_bytes_total{run}        counter  what data-parallel training would have moved
    idletrain_eval_loss{run}                           gauge    newest held-out loss (nats/byte)
    idletrain_workers{run,state}                       gauge    registered | live
    idletrain_credit_total{run}                        counter  coordinator/credit.py

Observed by the merger thread in this process (they start at zero with it):

    idletrain_merge_rejections_total{run,reason}       counter  reason: a robust.Rejection value, never free text
    idletrain_merge_seconds{run}                       histogram  one delta's merge and commit
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

from coordinator.runtime import MergeOutcome, RunRuntime
from coordinator.services.coordinator import Coordinator
from shared.algorithms.robust import Rejection

router = APIRouter(tags=["metrics"])


class _DatabaseCollector(Collector):
    """Every gauge and counter that reflects database state, read once per scrape."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    def collect(self):
        runs = self.coord.reports.metrics_sample()

        def family(kind, name: str, doc: str, labels: tuple[str, ...] = ()):
            return kind(name, doc, labels=["run", *labels])

        version = family(GaugeMetricFamily, "idletrain_model_version", "deltas processed (the model version)")
        merged = family(CounterMetricFamily, "idletrain_deltas_merged", "deltas merged into the global model")
        rejected = family(CounterMetricFamily, "idletrain_deltas_rejected",
                          "deltas refused at upload or rejected at merge", ("stage",))
        queued = family(GaugeMetricFamily, "idletrain_deltas_queued", "acknowledged deltas waiting for the merger")
        leases = family(GaugeMetricFamily, "idletrain_leases", "leases by state", ("state",))
        tokens = family(CounterMetricFamily, "idletrain_tokens_trained", "tokens in deltas accepted at upload")
        bytes_in = family(CounterMetricFamily, "idletrain_bytes_in", "bytes received: deltas and exchanges")
        bytes_out = family(CounterMetricFamily, "idletrain_bytes_out", "bytes sent: snapshots and exchange "
                                                                       "corrections (model), shards (data)", ("kind",))
        dense = family(CounterMetricFamily, "idletrain_dense_equivalent_bytes",
                       "bytes data-parallel training of the same steps would move")
        loss = family(GaugeMetricFamily, "idletrain_eval_loss", "newest held-out eval loss (nats per byte)")
        workers = family(GaugeMetricFamily, "idletrain_workers", "workers registered, and live now", ("state",))
        credit = family(CounterMetricFamily, "idletrain_credit", "credit awarded (coordinator/credit.py)")
        for r in runs:
            version.add_metric([r.name], r.version)
            merged.add_metric([r.name], r.merged_deltas)
            rejected.add_metric([r.name, "merge"], r.rejected_at_merge)
            rejected.add_metric([r.name, "upload"], r.refused_at_upload)
            queued.add_metric([r.name], r.queued_deltas)
            for state in ("active", "expired", "delivered", "abandoned"):
                leases.add_metric([r.name, state], r.leases.get(state, 0))
            tokens.add_metric([r.name], r.tokens_trained)
            bytes_in.add_metric([r.name], r.bytes_up)
            bytes_out.add_metric([r.name, "model"], r.bytes_down_model)
            bytes_out.add_metric([r.name, "data"], r.bytes_down_data)
            dense.add_metric([r.name], r.dense_equivalent_bytes)
            if r.eval_loss is not None:
                loss.add_metric([r.name], r.eval_loss)
            workers.add_metric([r.name, "registered"], r.workers_total)
            workers.add_metric([r.name, "live"], r.workers_live)
            credit.add_metric([r.name], r.credit_total)
        yield from (version, merged, rejected, queued, leases, tokens, bytes_in, bytes_out, dense, loss, workers,
                    credit)


class AppMetrics:
    """One app's registry: the database collector, and what the merger reports (observe_merge)."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_DatabaseCollector(coord))
        self.merge_rejections = Counter("idletrain_merge_rejections", "deltas the merger rejected, by reason class",
                                        ["run", "reason"], registry=self.registry)
        # From a tiny model's few milliseconds to a large one's seconds.
        self.merge_seconds = Histogram("idletrain_merge_seconds", "one delta's merge and commit", ["run"],
                                       buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                       registry=self.registry)

    def _known(self, run: str) -> None:
        """Every reason of a run exported from the start at 0, so rate() sees the first rejection."""
        for reason in Rejection:
            self.merge_rejections.labels(run, reason.value)
        self.merge_seconds.labels(run)

    def observe_merge(self, rt: RunRuntime, out: MergeOutcome, seconds: float) -> None:
        """Merger.on_merged: called from the merger thread after each delta's commit."""
        run = rt.config.name
        self._known(run)
        self.merge_seconds.labels(run).observe(seconds)
        if not out.merged:
            self.merge_rejections.labels(run, (out.rejection or Rejection.OTHER).value).inc()

    def render(self) -> bytes:
        for rt in self.coord.live.runtime_list():
            self._known(rt.config.name)
        return generate_latest(self.registry)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
async def metrics(request: Request) -> Response:
    """Counters and gauges of every run in the Prometheus text format (aggregates only; public like the
    dashboard)."""
    body = await run_in_threadpool(request.app.state.metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
