"""One row of the field: the processes it runs, on a built `Field`, and what they leave behind.

    idletrain   a real `idletrain coordinator serve` in the coordinator's namespace and N real `idletrain
                worker run` in the workers' (a fresh data dir; the run created over HTTP with the field's
                config, its other fields the defaults a run of that length gets); its curve is the
                coordinator's own evaluations (GET .../status, eval_history), at the wall time each was
                recorded
    ddp         bench.field.ddp's ranks (alone, ring, ps), or bench.field.hive's hivemind peers; its curve
                is the saved checkpoints, evaluated afterwards on the test and validation slices exactly as
                the coordinator evaluates

Each row's clock starts when the driver starts its workers (the coordinator, as in a real deployment,
already runs). A row returns its curve(s), its bytes per worker each way (interface counters), the
coordinator's, and what it ran.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.field.net import COORD_ADDR, Counters, Field
from shared.model import ModelConfig, build_model, evaluate_loss

PORT = 8000
MASTER_PORT = 29500
HIVE_PORT = 31337
REPO = Path(__file__).resolve().parents[2]


def _spawn(argv: list[str], log: Path, **kw) -> subprocess.Popen:
    f = open(log, "w")
    # one thread each; gloo binds to the namespace's eth0 (its hostname would resolve to loopback)
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0",
           "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(log.parent)}
    return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=REPO, **kw)


def _stop(procs: list[subprocess.Popen], sig: int = signal.SIGKILL) -> None:
    """Kill each process's whole group, also when its leader has exited: hivemind's p2p daemon outlives
    a peer that leaves with os._exit and would hold the next row's port."""
    for p in procs:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _http(field: Field, method: str, url: str, body: dict | None = None, token: str | None = None) -> dict:
    """An HTTP call from inside the coordinator's namespace (the driver has no address in the field)."""
    code = ("import httpx,json,sys;a=json.loads(sys.argv[1]);"
            "r=httpx.request(a['m'],a['u'],json=a['b'],headers=a['h'],timeout=120);"
            "print(json.dumps({'status':r.status_code,'body':r.json() if r.content else None}))")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    out = subprocess.run(field.command(field.coord, [sys.executable, "-c", code,
                                                     json.dumps({"m": method, "u": url, "b": body, "h": headers})]),
                         capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        raise RuntimeError(f"{method} {url}: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def _wait_healthy(field: Field, url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the coordinator exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if _http(field, "GET", f"{url}/healthz")["status"] == 200:
                return
        except RuntimeError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the coordinator did not answer in 300 s:\n{log.read_text()[-3000:]}")


def _bytes(field: Field, before: dict[str, Counters], workers: list[str], *, coordinator: bool) -> dict:
    """The row's bytes since `before`: per worker each way (mean and max over `workers`), and the
    coordinator's namespace's when the row used it (else 0)."""
    moved = {ns: field.counters(ns) - before[ns] for ns in before}
    ups, downs = [moved[ns].tx for ns in workers], [moved[ns].rx for ns in workers]
    coord = moved[field.coord] if coordinator else Counters(0, 0)
    return {"up_mean": sum(ups) / len(ups), "down_mean": sum(downs) / len(downs), "up_max": max(ups),
            "down_max": max(downs), "coordinator_up": coord.tx, "coordinator_down": coord.rx}


def run_idletrain(field: Field, run: dict, *, workers: int, duration_s: float, out: Path,
                  coord_share: float) -> dict:
    """The product: coordinator + `workers` workers for `duration_s` seconds of wall clock."""
    shutil.rmtree(out, ignore_errors=True)  # a fresh data dir: an earlier try's run would be in the way
    out.mkdir(parents=True)
    data = out / "data"
    url = f"http://{COORD_ADDR}:{PORT}"
    py = [sys.executable, "-m", "idletrain"]
    coord = _spawn(field.command(field.coord, [*py, "--log-level", "INFO", "coordinator", "serve", "--host", COORD_ADDR,
                                               "--port", str(PORT), "--data-dir", str(data)],
                                 cpu="coord", share=coord_share), out / "coordinator.log")
    procs = [coord]
    try:
        _wait_healthy(field, url, coord, out / "coordinator.log")
        token = (data / "admin_token").read_text().strip()
        created = _http(field, "POST", f"{url}/api/v1/runs", run, token)
        if created["status"] != 201:
            raise RuntimeError(f"run create: {created}")
        config = _http(field, "GET", f"{url}/api/v1/runs/{run['name']}/config")["body"]
        before = {ns: field.counters(ns) for ns in [field.coord, *map(field.worker, range(workers))]}
        started = time.time()
        for i in range(workers):
            procs.append(_spawn(field.command(field.worker(i), [
                *py, "--log-level", "INFO", "worker", "run", "--coordinator", url, "--run", run["name"],
                "--threads", "1", "--device", "cpu", "--when", "always", "--state-dir", str(out / f"w{i}"),
                "--name", f"w{i}"], cpu=f"w{i}"), out / f"worker{i}.log"))
        while time.time() < started + duration_s:
            time.sleep(1)
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"a process of the idletrain row exited early (rc {dead[0].returncode}); "
                                   f"see {out}")
        traffic = _bytes(field, before, [field.worker(i) for i in range(workers)], coordinator=True)
        _stop(procs[1:])
        status = _http(field, "GET", f"{url}/api/v1/runs/{run['name']}/status")["body"]
        throttled = {f"w{i}": field.throttled_s(f"w{i}") for i in range(workers)}
    finally:
        _stop(procs)
    from datetime import datetime
    curve = []
    for e in status["eval_history"]:
        t = datetime.fromisoformat(e["at"]).timestamp() - started
        if t <= duration_s:
            curve.append({"t": max(0.0, t), "tokens": e["tokens_trained"], "test": e["loss"], "version": e["version"]})
    (out / "status.json").write_text(json.dumps(status, indent=1))
    return {"curve": curve, "bytes": traffic, "merged": status["merged_deltas"],
            "rejected": status["rejected_deltas"], "throttled_s": throttled,
            "config": {k: config[k] for k in ("inner", "compression", "outer", "update_values") if k in config}}


def run_ddp(field: Field, spec: dict, *, out: Path, coord_share: float, python: str = sys.executable) -> dict:
    """bench.field.ddp's ranks: `spec["mode"]` alone / ring / ps over `spec["workers"]` workers; or with
    mode "hivemind", bench.field.hive's peers under `python` (a venv that holds hivemind)."""
    shutil.rmtree(out, ignore_errors=True)  # no checkpoint of an earlier try may join the curve
    out.mkdir(parents=True)
    mode, n = spec["mode"], spec["workers"]
    world = n + 1 if mode == "ps" else n
    host = COORD_ADDR if mode == "ps" else field.worker_addr(0)
    places = ([field.coord] if mode == "ps" else []) + [field.worker(spec.get("slot", 0) + i) for i in range(n)]
    spec = {**spec, "world": world, "master": f"{host}:{MASTER_PORT}", "out": str(out), "port": HIVE_PORT,
            "addrs": [field.worker_addr(spec.get("slot", 0) + i) for i in range(n)]}
    module = "bench.field.hive" if mode == "hivemind" else "bench.field.ddp"
    before = {ns: field.counters(ns) for ns in {field.coord, *places}}
    spec["started"] = started = time.time()
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    procs = []
    for rank, ns in enumerate(places):
        cpu = "coord" if ns == field.coord else f"{ns}-ddp"
        share = coord_share if ns == field.coord else None
        procs.append(_spawn(field.command(ns, [python, "-m", module, str(out / "spec.json"), str(rank)], cpu=cpu,
                                          share=share), out / f"rank{rank}.log"))
    try:
        deadline = started + spec["duration_s"] + 600
        while any(p.poll() is None for p in procs):
            if time.time() > deadline:
                raise RuntimeError(f"{mode} did not stop by its deadline; see {out}")
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
    finally:
        _stop(procs)
    if bad := [p.returncode for p in procs if p.returncode != 0]:
        raise RuntimeError(f"a {mode} rank exited {bad[0]}; see {out}")
    traffic = _bytes(field, before, [ns for ns in places if ns != field.coord], coordinator=mode == "ps")
    steps = json.loads((out / "steps.json").read_text())
    return {"bytes": traffic, "steps": steps["steps"],
            "step_s_mean": sum(steps["step_s"]) / max(1, len(steps["step_s"]))}


def evaluate_checkpoints(out: Path, model: dict, slices: dict[str, torch.Tensor], *, keep: bool = False) -> list[dict]:
    """Each checkpoint a ddp row saved, on every slice (shared.model.evaluate_loss, as the coordinator
    evaluates): its curve. The checkpoints go unless `keep`."""
    cfg = ModelConfig.from_dict(model)
    net = build_model(cfg)
    curve = []
    for path in sorted(out.glob("ckpt-*.pt")):
        ck = torch.load(path, weights_only=True)
        net.load_state_dict(ck["state"])
        point = {"t": ck["t"], "tokens": ck["tokens"], "step": ck["step"]}
        for name, tokens in slices.items():
            point[name] = evaluate_loss(net, tokens, context=cfg.context)
        curve.append(point)
        if not keep:
            path.unlink()
    return curve
