"""`idletrain demo`: a coordinator and N workers as separate processes on this machine, talking
real HTTP over loopback, on the built-in corpus. Ends with a summary (and --json, one JSON line)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from idletrain.harness import free_port, wait_healthy
from shared.config import RunConfig


def demo_config(*, workers: int, minutes: float) -> RunConfig:
    """Sized for a 2-core laptop: each worker gets about one core-share; rounds of 50 local steps."""
    steps, batch, context = 50, 16, 128
    # Each worker does about 3 local steps/s on a shared 2-core machine: decay the lr over that budget.
    expected_tokens = int(workers * minutes * 60 * 3 * batch * context / max(1, workers / 2))
    return RunConfig.model_validate({
        "name": "demo",
        "corpus_max_bytes": 6 << 20,
        "shard_tokens": 1 << 17,
        "eval_every": workers,
        "eval_tokens": 1 << 15,
        "lease_ttl_s": 300,
        "schedule_tokens": max(expected_tokens, 1 << 20),
        "epochs": 0,  # the demo ends on its clock: a long one goes round the data again rather than finish
        "inner": {"steps": steps, "batch_size": batch, "lr": 3e-3, "warmup_steps": 30},
        "outer": {"group": workers},  # compression and the outer optimiser keep the run defaults
    })


def rejection_reasons(metrics_text: str, run: str = "demo") -> dict[str, int]:
    """The run's rejected deltas by reason class, from the coordinator's /metrics (only those seen; none
    when the text is not the Prometheus format)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return {sample.labels["reason"]: int(sample.value)
                for family in text_string_to_metric_families(metrics_text)
                if family.name == "idletrain_merge_rejections" for sample in family.samples
                if sample.name.endswith("_total") and sample.labels.get("run") == run and sample.value > 0}
    except ValueError:
        return {}


def summarise(status: dict, reasons: dict[str, int] | None = None) -> dict:
    hist = status["eval_history"]
    return {
        "tokens_trained": status["tokens_trained"],
        "merged_deltas": status["merged_deltas"],
        "rejected_deltas": status["rejected_deltas"],
        "rejected_by_reason": reasons or {},
        "eval_loss_first": hist[0]["loss"] if hist else None,
        "eval_loss_last": hist[-1]["loss"] if hist else None,
        "bytes_up": status["bytes_up"],
        "bytes_down": status["bytes_down"],
        "traffic_ratio_vs_dense": status["traffic_ratio_vs_dense"],
    }


def run_demo(*, workers: int = 3, minutes: float = 3.0, as_json: bool = False, keep: bool = False) -> int:
    if workers < 1 or minutes <= 0:
        print("idletrain demo: --workers must be >= 1 and --minutes > 0", file=sys.stderr)
        return 2
    out = sys.stdout
    data_dir = Path(tempfile.mkdtemp(prefix="idletrain-demo-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    logs = data_dir / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []
    print(f"idletrain demo: coordinator at {url}, {workers} workers, {minutes:g} min of training; "
          f"logs in {logs}", file=out, flush=True)
    try:
        client = _start_coordinator(procs, port=port, data_dir=data_dir, env=env, workers=workers)
        _create_run(client, workers=workers, minutes=minutes, out=out)
        _start_workers(procs, url=url, data_dir=data_dir, env=env, workers=workers)
        _watch(client, procs, minutes=minutes, out=out)
        status = _stop_workers_and_evaluate(client, procs, out=out)
        reasons = rejection_reasons(client.get("/metrics").text) if status["rejected_deltas"] else {}
        summary = summarise(status, reasons)
        _print_summary(summary, status, out)
        if as_json:
            print(json.dumps(summary), file=out, flush=True)
        ok = summary["eval_loss_last"] is not None and summary["eval_loss_last"] < summary["eval_loss_first"]
        return 0 if ok and summary["merged_deltas"] > 0 else 1
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"\nidletrain demo failed: {exc} (logs: {logs})", file=sys.stderr)
        keep = True
        return 1
    finally:
        _stop_all(procs)
        if not keep:
            shutil.rmtree(data_dir, ignore_errors=True)


def _start_coordinator(procs: list[subprocess.Popen], *, port: int, data_dir: Path, env: dict,
                       workers: int) -> httpx.Client:
    """`idletrain coordinator serve` in a process of its own (procs[0]); a client of it once it answers."""
    admin_token = secrets.token_urlsafe(32)  # operator routes always need one; through the environment, not argv
    coord = subprocess.Popen(
        [sys.executable, "-m", "idletrain", "--log-level", "WARNING", "coordinator", "serve",
         "--port", str(port), "--data-dir", str(data_dir / "coordinator")],
        # every demo worker registers and leases from 127.0.0.1: the per-address limits fit them all
        env={**env, "IDLETRAIN_ADMIN_TOKEN": admin_token, "IDLETRAIN_REGISTER_BURST": str(max(8, workers)),
             "IDLETRAIN_MAX_LEASES_PER_ADDRESS": str(max(32, 2 * workers))},
        stdout=open(data_dir / "logs" / "coordinator.log", "w"),
        stderr=subprocess.STDOUT)
    procs.append(coord)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600,
                          headers={"Authorization": f"Bearer {admin_token}"})
    wait_healthy(client, coord)
    return client


def _create_run(client: httpx.Client, *, workers: int, minutes: float, out) -> None:
    cfg = demo_config(workers=workers, minutes=minutes)
    resp = client.post("/api/v1/runs", json=json.loads(cfg.model_dump_json()))
    if resp.status_code != 201:
        raise RuntimeError(f"creating the demo run failed: {resp.status_code} {resp.text}")
    created = resp.json()
    print(f"run 'demo': {created['n_params']:,} parameters, {created['n_shards']} shards of the Python "
          f"standard library ({created['train_tokens'] / 1e6:.1f} MB), held-out {created['eval_tokens']:,} bytes",
          file=out, flush=True)


def _start_workers(procs: list[subprocess.Popen], *, url: str, data_dir: Path, env: dict, workers: int) -> None:
    empty_config = data_dir / "worker.toml"
    empty_config.write_text("# the demo's workers use their defaults, not ~/.config/idletrain/worker.toml\n")
    for i in range(workers):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "idletrain", "worker", "run", "--coordinator", url, "--run", "demo",
             "--threads", "1", "--device", "cpu", "--state-dir", str(data_dir / f"worker{i}"),
             "--name", f"demo-worker-{i}",
             # the demo trains now, whatever this machine's worker.toml says (idleness, battery, caps)
             "--config", str(empty_config), "--when", "always", "--on-battery", "run"],
            env=env, stdout=open(data_dir / "logs" / f"worker{i}.log", "w"), stderr=subprocess.STDOUT))


def _watch(client: httpx.Client, procs: list[subprocess.Popen], *, minutes: float, out) -> None:
    """Training time: a progress line (rewritten in place on a terminal, every 15 s otherwise)."""
    tty = out.isatty()
    coord = procs[0]
    t_end = time.monotonic() + minutes * 60
    last_line = 0.0
    while time.monotonic() < t_end:
        time.sleep(1.0)
        if coord.poll() is not None:
            raise RuntimeError("the coordinator died; see its log")
        if all(p.poll() is not None for p in procs[1:]):
            raise RuntimeError("every worker exited; see their logs")
        st = client.get("/api/v1/runs/demo/status").json()
        line = _progress(st, t_end - time.monotonic())
        if tty:
            print("\r" + line[:160].ljust(160), end="", file=out, flush=True)
        elif time.monotonic() - last_line > 15:
            print(line, file=out, flush=True)
            last_line = time.monotonic()
    if tty:
        print(file=out)


def _stop_workers_and_evaluate(client: httpx.Client, procs: list[subprocess.Popen], *, out) -> dict:
    """Stop the workers (each saves its round in flight, an upload in flight lands), let the merger
    drain, evaluate; the run's status."""
    print("stopping workers (each saves its round in flight; an upload in flight still lands)…", file=out,
          flush=True)
    for p in procs[1:]:
        p.send_signal(signal.SIGINT)
    for p in procs[1:]:
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
    deadline = time.monotonic() + 120
    while client.get("/api/v1/runs/demo/status").json()["pending_deltas"] and time.monotonic() < deadline:
        time.sleep(0.5)
    client.post("/api/v1/runs/demo/evaluate")
    return client.get("/api/v1/runs/demo/status").json()


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT if p is procs[0] else signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def _progress(st: dict, left_s: float) -> str:
    hist = st["eval_history"]
    loss = f"{hist[-1]['loss']:.3f}" if hist else "-"
    ratio = st.get("traffic_ratio_vs_dense")
    return (f"[{max(0, left_s):4.0f}s left] v{st['version']} merged {st['merged_deltas']} | workers "
            f"{st['workers_active']} | tokens {st['tokens_trained'] / 1e6:.2f}M | eval loss {loss} | up "
            f"{st['bytes_up'] / 1e6:.1f} MB down {st['bytes_down'] / 1e6:.1f} MB"
            + (f" | {ratio:.0f}x < dense" if ratio else ""))


def _print_summary(summary: dict, status: dict, out) -> None:
    first, last = summary["eval_loss_first"], summary["eval_loss_last"]
    print("\nsummary", file=out)
    print(f"  tokens trained        {summary['tokens_trained']:,} ({status['worker_steps']:,} local steps)", file=out)
    why = ", ".join(f"{reason} {n}" for reason, n in sorted(summary["rejected_by_reason"].items()))
    print(f"  deltas merged         {summary['merged_deltas']} (version {status['version']}, "
          f"{status['rejected_deltas']} rejected{': ' + why if why else ''})", file=out)
    print(f"  eval loss (nats/byte) {first:.3f} -> {last:.3f}", file=out)
    print(f"  bytes up / down       {summary['bytes_up'] / 1e6:.2f} MB / {summary['bytes_down'] / 1e6:.2f} MB "
          f"(model {status['bytes_down_model'] / 1e6:.2f} MB, data {status['bytes_down_data'] / 1e6:.2f} MB)",
          file=out)
    ratio = summary["traffic_ratio_vs_dense"]
    print(f"  dense data-parallel   {status['dense_equivalent_bytes'] / 1e9:.2f} GB for the same steps "
          f"-> {ratio:.0f}x less traffic" if ratio else "  traffic ratio         n/a", file=out, flush=True)
