"""deploy/nginx/idletrain.conf in front of a real coordinator: a real nginx (Debian's package) caches
numbered snapshots and updates, so a herd of workers asking for the same version costs the
coordinator one download, while `latest`, uploads and the rest pass through uncached.

The shipped site file is used as is, with only its ports and paths swapped for the test's; the
coordinator's own byte counter (`bytes_down_model`: every snapshot or update body it sends) and
its access log prove what reached it."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from idletrain.harness import free_port
from shared import codec, protocol
from shared.algorithms.compress import compress
from shared.model import build_model, param_schema
from tests import procs

SITE = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "idletrain.conf"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)  # sbin: not on PATH
RUN = "cache"
P = f"{protocol.API_PREFIX}/runs/{RUN}"
DELTAS = 3  # group 1: every delta is a version, so versions 0..3 exist
HERD = 15  # concurrent requests per version


def render_site(coord_port: int, nginx_port: int, root: Path) -> str:
    """The shipped site with the test's upstream, listen address, cache dir and access log."""
    text = SITE.read_text()
    swaps = {"server 127.0.0.1:8000;": f"server 127.0.0.1:{coord_port};",
             "listen 80;": f"listen 127.0.0.1:{nginx_port};",
             "listen [::]:80;": "",
             "proxy_cache_path /var/cache/nginx/idletrain ": f"proxy_cache_path {root / 'cache'} ",
             "access_log /var/log/nginx/idletrain.access.log ": f"access_log {root / 'access.log'} "}
    for old, new in swaps.items():
        assert text.count(old) == 1, f"{SITE} no longer holds {old!r} exactly once; update this test's swaps"
        text = text.replace(old, new)
    return text


def main_conf(root: Path, site: Path) -> str:
    """A minimal nginx.conf around the site, every path inside `root` (runs as any user)."""
    temp = "\n".join(f"    {kind}_temp_path {root / 'tmp' / kind};"
                     for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    # As root, nginx's workers would drop to `nobody` and could not enter pytest's 0700 tmp dir.
    user = "user root;\n" if os.geteuid() == 0 else ""
    return (f"{user}worker_processes 2;\npid {root / 'nginx.pid'};\nerror_log {root / 'error.log'} info;\n"
            f"events {{ worker_connections 256; }}\n"
            f"http {{\n    default_type application/octet-stream;\n{temp}\n    include {site};\n}}\n")


def upload_delta(http: httpx.Client, token: str) -> None:
    """Lease, a seeded random delta, POST it (through nginx): one new version once merged."""
    auth = {"Authorization": f"Bearer {token}"}
    resp = http.post(f"{P}/leases", headers=auth)
    assert resp.status_code == 200, resp.text
    lease = protocol.Lease.model_validate(resp.json())
    schema = param_schema(build_model(lease.model))
    gen = torch.Generator().manual_seed(lease.lease_id)
    grads = {name: torch.randn(shape, generator=gen) * 1e-3 for name, shape in schema.items()}
    body = codec.encode(compress(grads, lease.compression, base_version=lease.base_version, round_seed=lease.seed))
    resp = http.post(f"{protocol.API_PREFIX}/leases/{lease.lease_id}/delta", content=body,
                     headers={**auth, "Content-Type": "application/octet-stream"})
    assert resp.status_code == 202, resp.text
    assert "x-cache-status" not in resp.headers, "an upload went through the cache"


@pytest.mark.slow
@pytest.mark.skipif(NGINX is None, reason="!!! NGINX IS NOT INSTALLED: the nginx cache test (deploy/nginx/"
                                          "idletrain.conf in front of a real coordinator) DID NOT RUN; "
                                          "apt-get install nginx !!!")
def test_nginx_caches_snapshots_and_updates_for_a_herd_of_workers(tmp_path: Path, corpus_dir: Path):
    coord_port, nginx_port = free_port(), free_port()
    root = tmp_path / "nginx"
    for sub in ("cache", "tmp"):
        (root / sub).mkdir(parents=True)
    site, conf = root / "idletrain.conf", root / "nginx.conf"
    site.write_text(render_site(coord_port, nginx_port, root))
    conf.write_text(main_conf(root, site))
    coord_log, nginx_out = tmp_path / "coordinator.log", tmp_path / "nginx.out"
    spawned: list[subprocess.Popen] = []
    files = []
    t0 = time.monotonic()
    try:
        checked = subprocess.run([NGINX, "-t", "-c", str(conf), "-p", str(root)], capture_output=True, text=True,
                                 timeout=30)
        assert checked.returncode == 0, f"nginx -t refused the rendered {SITE}:\n{checked.stderr}\n{site.read_text()}"

        files.append(coord_log.open("wb"))  # DEBUG: uvicorn's access log, one line per request that reached it
        coord = procs.popen([sys.executable, "-m", "idletrain", "--log-level", "DEBUG", "coordinator", "serve",
                                  "--host", "127.0.0.1", "--port", str(coord_port),
                                  "--data-dir", str(tmp_path / "data"), "--corpus-dir", str(corpus_dir)],
                                 env=procs.env(), cwd=tmp_path, stdout=files[-1], stderr=subprocess.STDOUT)
        spawned.append(coord)
        files.append(nginx_out.open("wb"))
        nginx = procs.popen([NGINX, "-c", str(conf), "-p", str(root), "-g", "daemon off;"],
                                 stdout=files[-1], stderr=subprocess.STDOUT)
        spawned.append(nginx)

        direct = httpx.Client(base_url=f"http://127.0.0.1:{coord_port}", timeout=60)
        front = httpx.Client(base_url=f"http://127.0.0.1:{nginx_port}", timeout=60,
                             limits=httpx.Limits(max_connections=100, max_keepalive_connections=100))
        procs.wait_healthy(direct, coord, coord_log)
        procs.wait_healthy(front, nginx, root / "error.log", timeout_s=60)  # /healthz through nginx
        started = time.monotonic()

        # A run with a version per delta; the run, the worker and every upload go through nginx.
        # the operator's run creation goes through nginx too: the token is what guards it
        created = front.post(f"{protocol.API_PREFIX}/runs", headers=procs.admin_headers(tmp_path / "data"), json={
            "name": RUN, "corpus": str(corpus_dir), "corpus_max_bytes": 1 << 18, "shard_tokens": 4096,
            "eval_tokens": 4096, "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
            "inner": {"steps": 3, "batch_size": 2}, "outer": {"group": 1},
            "compression": {"index": "dense", "values": "int8", "error_feedback": False}})
        assert created.status_code == 201, created.text
        # nginx forwards from 127.0.0.1, and the coordinator still wants the operator's token
        assert front.post(f"{P}/pause").status_code == 401
        assert front.get("/healthz", headers={"Host": "rebound.example"}).status_code == 400  # a name it is not
        token = front.post(f"{P}/workers", json={}).json()["token"]
        for k in range(1, DELTAS + 1):
            upload_delta(front, token)
            deadline = time.monotonic() + 30
            while (st := direct.get(f"{P}/status").json())["version"] < k and time.monotonic() < deadline:
                time.sleep(0.05)
            assert st["version"] == k, st
        assert st["merged_deltas"] == DELTAS and st["rejected_deltas"] == 0, st
        versions = list(range(DELTAS + 1))

        def served() -> int:  # model bytes the coordinator itself has sent
            return direct.get(f"{P}/status").json()["bytes_down_model"]

        def upstream_gets(path: str) -> int:  # requests for `path` that reached the coordinator
            return procs.tail(coord_log, 10**9).count(f'"GET {path} HTTP/1.1" ')

        herd_pool = ThreadPoolExecutor(max_workers=HERD * len(versions))
        auth = {"Authorization": f"Bearer {token}"}  # as workers send it; the snapshots are public anyway

        def herd(paths: list[str]) -> list[httpx.Response]:
            """Every path at once, each from its own thread, released together by a barrier."""
            gate = threading.Barrier(len(paths))

            def one(path: str) -> httpx.Response:
                gate.wait(timeout=30)
                return front.get(path, headers=auth)

            return list(herd_pool.map(one, paths))

        # 1. The herd: HERD workers per version, all versions at once, nothing cached yet.
        before = served()
        paths = [f"{P}/snapshots/{v}" for _ in range(HERD) for v in versions]
        t_herd = time.monotonic()
        answers = herd(paths)
        t_herd = time.monotonic() - t_herd
        sizes, hits = {}, Counter()
        for path, r in zip(paths, answers):
            assert r.status_code == 200, (path, r.status_code, r.text[:200])
            sha = hashlib.sha256(r.content).hexdigest()
            assert r.headers[protocol.H_SHA256] == sha and r.headers["etag"] == f'"{sha}"', path
            assert "immutable" in r.headers["cache-control"]
            assert sizes.setdefault(path, (len(r.content), sha)) == (len(r.content), sha), f"{path}: bytes differ"
            hits[(path, r.headers.get("x-cache-status"))] += 1
        for v in versions:
            path = f"{P}/snapshots/{v}"
            got = {status: n for (p, status), n in hits.items() if p == path}
            assert got == {"MISS": 1, "HIT": HERD - 1}, (path, got)  # proxy_cache_lock: one fetch per version
            assert upstream_gets(path) == 1, (path, upstream_gets(path))
        assert len({sha for _, sha in sizes.values()}) == len(versions)
        one_each = sum(n for n, _ in sizes.values())
        after = served()
        assert after - before == one_each, (before, after, one_each)  # the coordinator sent each version once
        through_nginx = sum(len(r.content) for r in answers)

        # 2. Later askers: HITs, and a revalidation (If-None-Match) is answered by nginx with 304.
        path = f"{P}/snapshots/{DELTAS}"
        for _ in range(5):
            r = front.get(path, headers=auth)
            assert r.status_code == 200 and r.headers["x-cache-status"] == "HIT"
        r = front.get(path, headers={**auth, "If-None-Match": f'"{sizes[path][1]}"'})
        assert r.status_code == 304 and r.headers["x-cache-status"] == "HIT", (r.status_code, r.headers)
        r = front.get(f"{path}?cachebust=1", headers=auth)  # the key is the path: no bypass by query string
        assert r.status_code == 200 and r.headers["x-cache-status"] == "HIT" and r.content
        assert served() == after and upstream_gets(path) == 1

        # 3. `latest` is never cached: every request reaches the coordinator.
        latest = f"{P}/snapshots/latest"
        for _ in range(3):
            r = front.get(latest, headers=auth)
            assert r.status_code == 200 and r.headers["cache-control"] == "no-cache"
            assert r.headers[protocol.H_VERSION] == str(DELTAS) and "x-cache-status" not in r.headers, r.headers
            assert r.content == answers[paths.index(path)].content
        assert served() == after + 3 * sizes[path][0] and upstream_gets(latest) == 3
        after = served()

        # 4. An update a -> b is cached the same way: a herd of 20, one upstream fetch.
        upd = f"{P}/updates/1/{DELTAS}"
        answers_u = herd([upd] * 20)
        assert all(r.status_code == 200 for r in answers_u), [r.status_code for r in answers_u]
        assert len({r.content for r in answers_u}) == 1
        sha = hashlib.sha256(answers_u[0].content).hexdigest()
        assert all(r.headers[protocol.H_SHA256] == sha for r in answers_u)
        assert Counter(r.headers["x-cache-status"] for r in answers_u) == {"MISS": 1, "HIT": 19}
        assert served() == after + len(answers_u[0].content) and upstream_gets(upd) == 1

        # 5. A version that does not exist yet is never cached (it will, soon).
        missing = f"{P}/snapshots/{DELTAS + 1}"
        statuses = [front.get(missing, headers=auth) for _ in range(2)]
        assert [(r.status_code, r.headers.get("x-cache-status")) for r in statuses] == [(404, "MISS")] * 2
        assert upstream_gets(missing) == 2
        upload_delta(front, token)  # ... and once it exists, it is served (and then cached)
        deadline = time.monotonic() + 30
        while direct.get(f"{P}/status").json()["version"] <= DELTAS and time.monotonic() < deadline:
            time.sleep(0.05)
        got = [front.get(missing, headers=auth) for _ in range(2)]
        assert [(r.status_code, r.headers.get("x-cache-status")) for r in got] == [(200, "MISS"), (200, "HIT")]

        # nginx's own log agrees: it went upstream for each of the herd's versions once.
        log = (root / "access.log").read_text().splitlines()
        herd_lines = [ln for ln in log if "/snapshots/" in ln and "latest" not in ln and f"/{DELTAS + 1} " not in ln]
        assert sum("cache=MISS" in ln for ln in herd_lines) == len(versions), "\n".join(herd_lines)

        print(f"\nnginx {NGINX}: herd of {len(paths)} snapshot requests ({HERD} x versions {versions}) in "
              f"{t_herd:.2f}s: {through_nginx} bytes to workers, {one_each} bytes from the coordinator "
              f"({len(versions)} MISS, {len(paths) - len(versions)} HIT); update herd 20 -> 1 upstream fetch; "
              f"{time.monotonic() - started:.1f}s after start-up, {time.monotonic() - t0:.1f}s in all")
        herd_pool.shutdown()
        direct.close()
        front.close()
    except BaseException:
        print(f"--- nginx error log ---\n{procs.tail(root / 'error.log', 6000)}\n--- nginx stdout/stderr ---\n"
              f"{procs.tail(nginx_out)}\n--- nginx access log ---\n{procs.tail(root / 'access.log', 4000)}\n"
              f"--- coordinator log ---\n{procs.tail(coord_log, 6000)}")
        raise
    finally:
        for proc in reversed(spawned):  # nginx first (SIGTERM: fast shutdown), then the coordinator
            procs.stop(proc, signal.SIGTERM)
        for f in files:
            f.close()
