"""`python -m bench utilisation`: the fraction of wall time a real worker spends computing, with its
uploads throttled (10 Mbit/s by default), overlap off and on, side by side in one run.

A real coordinator runs as a subprocess on loopback (`idletrain coordinator serve`, SQLite, a fresh
data dir), with one run of the default small model (0.64M parameters) per worker run, its deltas
and model updates compressed as a run's defaults (int4 both ways: a dense delta of ~320 KB, about a
quarter second at 10 Mbit/s), or as --values / --update-values say (int8: ~650 KB, half a second). A real worker (worker.loop.Worker, in this process, one
torch thread, a fresh state dir each time) trains `rounds` rounds of `steps` local steps against it,
its uploads paced by --max-upload-kbps (downloads are not limited), once per mode:

    off    settings.overlap = False: upload the delta, then ask for the next lease (the old loop)
    on     settings.overlap = True, lease_ahead off: the upload runs on a background thread while
           the worker saves its state, but the next lease is asked for only once the upload is
           answered (what the worker does with a coordinator that gives up every earlier lease of a
           worker asking for a new one, the one still uploading included)
    ahead  settings.overlap = True with lease_ahead: the next lease (naming the one still uploading,
           `?keep=`), its model update and its shard are fetched and the next round trains while
           the upload runs. Needs a coordinator that keeps that lease (/healthz says
           keeps_delivering_lease). When the coordinator under test does not, this mode runs against
           a second coordinator process whose lease grant gives no earlier lease up
           (queries.leases.end_lease patched to skip "abandoned"), and the results say so.

Utilisation = compute / wall, from the worker's first lease request to its last acknowledged
upload, both measured by the worker (worker.progress.Utilisation): compute is the time spent in
the trainer's rounds (the local steps and the delta's compression); wall includes the first full
snapshot download, every lease request, incremental model download, shard download, state save,
and every second of upload the training did not hide. The modes run interleaved, `repeats` times,
on the same coordinator, so a busy machine disturbs them alike; the median is reported. Each worker
run trains a run of its own (util-<mode>-<repeat>) from the same initial model, so every mode
starts alike (docs/BENCHMARKS.md: what a shared run did to the screening before workers started
their rounds past their own unmerged deltas).
Writes results.json, results.md and utilisation.png.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from bench.utilisation_report import GOAL, markdown, plot
from idletrain.harness import free_port, wait_healthy
from shared import protocol
from shared.config import RunConfig
from shared.model import ModelConfig
from worker.client import CoordinatorError

log = logging.getLogger(__name__)

RUN = "util"
API = protocol.API_PREFIX

# The coordinator process of mode "ahead": the lease grant gives no earlier lease up (see above).
_KEEPING = """
import sys
import coordinator.queries.leases as q
_end_lease = q.end_lease
q.end_lease = lambda c, lease, shard, state: None if state == "abandoned" else _end_lease(c, lease, shard, state)
from idletrain.cli import main
sys.exit(main(sys.argv[1:]))
"""
_PLAIN = "import sys\nfrom idletrain.cli import main\nsys.exit(main(sys.argv[1:]))\n"


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    label: str
    overlap: bool
    lease_ahead: bool


MODES = {
    "off": Mode("off", "overlap off (worker setting overlap = false)", overlap=False, lease_ahead=False),
    "on": Mode("on", "overlap on, next lease after the upload's answer", overlap=True, lease_ahead=False),
    "ahead": Mode("ahead", "overlap on, next lease and round during the upload", overlap=True, lease_ahead=True),
}


def _folder_of(corpus: Path) -> Path:
    """The folder a corpus path needs allowed: itself, or a file's own folder."""
    corpus = corpus.resolve()
    return corpus if corpus.is_dir() else corpus.parent


class Coordinator:
    """`idletrain coordinator serve` on loopback in a subprocess, with a fresh data dir."""

    def __init__(self, root: Path, *, keeping: bool, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / f"coordinator-{'keeping' if keeping else 'plain'}.log"
        self._log = open(self.log_path, "w")
        args = ["--log-level", "WARNING", "coordinator", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--data-dir", str(root / f"data-{'keeping' if keeping else 'plain'}")]
        self.proc = subprocess.Popen([sys.executable, "-c", _KEEPING if keeping else _PLAIN, *args], env=env,
                                     cwd=root, stdout=self._log, stderr=subprocess.STDOUT)
        # create_run, status and healthz only: the operator's token on each is harmless
        self.http = httpx.Client(base_url=self.url, timeout=300,
                                 headers={"Authorization": f"Bearer {env['IDLETRAIN_ADMIN_TOKEN']}"})
        try:
            wait_healthy(self.http, self.proc, 120)
        except RuntimeError as exc:
            self.close()
            raise RuntimeError(f"{exc}:\n{self.log_path.read_text()[-3000:]}") from None

    def create_run(self, config: dict) -> None:
        resp = self.http.post(f"{API}/runs", json=config)
        if resp.status_code != 201:
            raise RuntimeError(f"creating the run failed: {resp.status_code} {resp.text}")

    def keeps_delivering_lease(self) -> bool:
        return bool(self.http.get("/healthz").json().get("keeps_delivering_lease", False))

    def status(self, run: str) -> dict:
        return self.http.get(f"{API}/runs/{run}/status").json()

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def run_config(*, name: str, steps: int, batch: int, model: ModelConfig, shard_tokens: int,
               corpus: str | None = None, relax_screening: bool = False, values: str | None = None,
               update_values: str | None = None) -> dict:
    """values / update_values: the run's delta and model-update values (None: the run defaults)."""
    defaults = RunConfig(name="defaults")
    return {
        "name": name, "corpus_max_bytes": 1 << 20, **({"corpus": corpus} if corpus else {}),
        "shard_tokens": shard_tokens, "eval_tokens": 4096,
        "eval_every": 1_000_000,  # no evaluations: they would take the coordinator's CPU from the worker
        "epochs": 0,  # the rounds measured may go round the data more than once; the run must not finish
        "model": dataclasses.asdict(model),
        "inner": {"steps": steps, "batch_size": batch, "lr": 1e-3, "warmup_steps": min(5, steps)},
        "compression": {"index": "dense", "values": values or defaults.compression.values},
        "update_values": update_values or defaults.update_values,
        # The run's robust screening as configured by default, unless relaxed (docs/BENCHMARKS.md: a
        # worker whose rounds started from a base without its own previous delta was once rejected).
        "robust": {"min_cosine": -1.0} if relax_screening else {},
    }


def measure(mode: Mode, url: str, run: str, state_dir: Path, *, rounds: int, upload_kbps: float,
            threads: int) -> dict:
    """One worker, `rounds` rounds, from a fresh state dir: what its Utilisation counted."""
    from worker.loop import Worker
    from worker.progress import PlainDisplay
    from worker.settings import WorkerSettings

    settings = WorkerSettings(coordinator=url, run=run, state_dir=state_dir, device="cpu", threads=threads,
                              max_rounds=rounds, overlap=mode.overlap, max_upload_kbps=upload_kbps,
                              name=f"bench-{mode.name}")
    worker = Worker(settings, display=PlainDisplay(every_s=3600.0))
    worker.lease_ahead = mode.lease_ahead
    try:
        delivered = worker.run()
    finally:
        worker.trainer.close()
        worker.client.close()
    if delivered != rounds:
        raise RuntimeError(f"mode {mode.name}: {delivered} of {rounds} rounds delivered")
    u = worker.progress.utilisation
    wall = u.wall_s() or 0.0
    # the download goal: after joining (version 0 of a fresh run: built from the run's seed, or one full
    # snapshot) a worker fetches only the change to each new version, so it downloads about what it uploads
    return {"mode": mode.name, "join_snapshot_bytes": worker.join_bytes or 0, "rounds": delivered,
            "utilisation": u.fraction(), "compute_s": u.compute_s,
            "wall_s": wall, "idle_s": wall - u.compute_s, "upload_wait_s": u.upload_wait_s,
            "bytes_sent": worker.client.sent_bytes, "bytes_received": worker.client.received_bytes,
            "phase_s": dict(u.phase_s)}


def warm_up(model: ModelConfig, *, batch: int, threads: int) -> None:
    """A few untimed local steps first: torch's one-off start-up costs belong to no mode."""
    from shared.algorithms.inner import make_optimizer, run_steps
    from shared.config import InnerConfig
    from shared.model import build_model

    torch.set_num_threads(threads)
    net = build_model(model)
    inner = InnerConfig(steps=3, batch_size=batch, warmup_steps=1)
    tokens = torch.randint(0, model.vocab_size, (model.context * batch * 4,), dtype=torch.uint8)
    run_steps(net, make_optimizer(net, inner), tokens, inner, lr=1e-3, steps=3, generator=torch.Generator(),
              step_offset=0)


def summarise(samples: list[dict]) -> dict:
    failed = [s["error"] for s in samples if "error" in s]
    samples = [s for s in samples if "error" not in s]
    if not samples:
        return {"failed": failed, "goal_met": False}
    util = [s["utilisation"] for s in samples]
    per_round = [s["wall_s"] / s["rounds"] for s in samples]
    compute_round = [s["compute_s"] / s["rounds"] for s in samples]
    return {"utilisation_median": statistics.median(util), "utilisation_min": min(util), "utilisation_max": max(util),
            "wall_per_round_s": statistics.median(per_round), "compute_per_round_s": statistics.median(compute_round),
            "idle_per_round_s": statistics.median(w - c for w, c in zip(per_round, compute_round, strict=True)),
            "upload_wait_per_round_s": statistics.median(s["upload_wait_s"] / s["rounds"] for s in samples),
            "sent_per_round_bytes": statistics.median(s["bytes_sent"] / s["rounds"] for s in samples),
            "received_per_round_after_join_bytes": statistics.median(
                (s["bytes_received"] - s["join_snapshot_bytes"]) / s["rounds"] for s in samples),
            "down_over_up_after_join": statistics.median(
                (s["bytes_received"] - s["join_snapshot_bytes"]) / s["bytes_sent"] for s in samples),
            "phase_per_round_s": {p: statistics.median(s["phase_s"].get(p, 0.0) / s["rounds"] for s in samples)
                                  for p in sorted({p for s in samples for p in s["phase_s"]})},
            "goal_met": statistics.median(util) >= GOAL, "failed": failed}


def run(*, out: Path, rounds: int = 16, repeats: int = 2, steps: int = 20, batch: int = 8,
        model: ModelConfig | None = None, upload_kbps: float = 10_000.0, threads: int = 1,
        modes: tuple[str, ...] = ("off", "on", "ahead"), shard_tokens: int = 1 << 16,
        coordinator_env: dict[str, str] | None = None, corpus: str | None = None, relax_screening: bool = False,
        values: str | None = None, update_values: str | None = None, command: str = "") -> dict:
    """Measure every mode `repeats` times; `corpus` (a path on this machine) instead of the built-in one."""
    model = model or ModelConfig()
    chosen = [MODES[m] for m in modes]
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="idletrain-util-"))
    env = _coordinator_env(corpus, coordinator_env)
    coords: dict[str, Coordinator] = {}
    patched = False
    t_start = time.time()

    def config(name: str) -> dict:
        return run_config(name=name, steps=steps, batch=batch, model=model, shard_tokens=shard_tokens,
                          corpus=corpus, relax_screening=relax_screening, values=values,
                          update_values=update_values)

    try:
        coords["plain"] = Coordinator(root, keeping=False, env=env)
        if any(m.lease_ahead for m in chosen) and not coords["plain"].keeps_delivering_lease():
            patched = True
            coords["patched"] = Coordinator(root, keeping=True, env=env)

        def coordinator_of(mode: Mode) -> Coordinator:
            return coords["patched" if patched and mode.lease_ahead else "plain"]

        runs: dict[tuple[str, int], str] = {}
        for rep in range(repeats):  # every worker run trains a run of its own from the same start
            for mode in chosen:
                runs[mode.name, rep] = f"{RUN}-{mode.name}-{rep}"
                coordinator_of(mode).create_run(config(runs[mode.name, rep]))
        warm_up(model, batch=batch, threads=threads)
        samples = _measure_modes(chosen, coordinator_of, runs, root, repeats=repeats, rounds=rounds,
                                 upload_kbps=upload_kbps, threads=threads)
        statuses = {run: coordinator_of(MODES[m]).status(run) for (m, _), run in runs.items()}
    finally:
        for c in coords.values():
            c.close()
        shutil.rmtree(root, ignore_errors=True)
    delta_bytes = None
    good = [s for ss in samples.values() for s in ss if "error" not in s]
    if good:
        delta_bytes = statistics.median(s["bytes_sent"] / s["rounds"] for s in good)
    example = config("x")  # what every run of this measurement was created with, but its name
    result = {
        "command": command, "goal": GOAL, "rounds": rounds, "repeats": repeats, "steps": steps, "batch": batch,
        "model": dataclasses.asdict(model), "n_params": model.n_params(), "upload_kbps": upload_kbps,
        "threads": threads, "sent_per_round_bytes": delta_bytes, "robust": example["robust"],
        "values": example["compression"]["values"], "update_values": example["update_values"],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "seconds": time.time() - t_start,
        "modes": {m.name: {"label": m.label, "overlap": m.overlap, "lease_ahead": m.lease_ahead,
                           "patched_coordinator": patched and m.lease_ahead, "summary": summarise(samples[m.name]),
                           "samples": samples[m.name]} for m in chosen},
        "run_status": {k: {f: v.get(f) for f in ("version", "merged_deltas", "rejected_deltas")}
                       for k, v in statuses.items()},
    }
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "results.md").write_text(markdown(result))
    plot(result, out / "utilisation.png")
    return result


def _coordinator_env(corpus: str | None, extra: dict[str, str] | None) -> dict[str, str]:
    """The coordinators' environment: none of the caller's IDLETRAIN_*, one thread, no registration limit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDLETRAIN_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", IDLETRAIN_REGISTER_RATE="0",
               # operator routes always need the admin token; a corpus path must be in an allowed folder
               IDLETRAIN_ADMIN_TOKEN=secrets.token_urlsafe(32),
               **({"IDLETRAIN_CORPUS_DIRS": str(_folder_of(Path(corpus)))} if corpus else {}),
               **(extra or {}))
    return env


def _measure_modes(chosen: list[Mode], coordinator_of, runs: dict[tuple[str, int], str], root: Path, *,
                   repeats: int, rounds: int, upload_kbps: float, threads: int) -> dict[str, list[dict]]:
    """Every mode once per repeat, interleaved; a failed worker run is a sample that says why."""
    samples: dict[str, list[dict]] = {m.name: [] for m in chosen}
    for rep in range(repeats):
        for mode in chosen:
            coord = coordinator_of(mode)
            try:
                sample = measure(mode, coord.url, runs[mode.name, rep], root / f"worker-{mode.name}-{rep}",
                                 rounds=rounds,
                                 upload_kbps=upload_kbps, threads=threads)
            except (CoordinatorError, RuntimeError) as exc:  # e.g. banned by robust screening: say so
                log.warning("%s, repeat %d failed: %s", mode.name, rep, exc)
                samples[mode.name].append({"mode": mode.name, "repeat": rep, "error": str(exc)})
                continue
            sample["repeat"] = rep
            samples[mode.name].append(sample)
            log.info("%s, repeat %d: %.1f%% computing (%.1f s of %.1f s)", mode.name, rep,
                     100 * sample["utilisation"], sample["compute_s"], sample["wall_s"])
    return samples
