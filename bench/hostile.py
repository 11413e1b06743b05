"""docs/reliability.md's figures for a hostile coordinator and an oversized record: `python -m
bench.hostile [--seconds 60] [--record-mb 300]` prints them as a table.

    worker      a real worker (its own process, its default caps from this machine's memory) leases,
                forever, a 23k-parameter model from a coordinator that answers every snapshot request
                with 3 GiB, with and without a Content-Length: the body bytes it read, the snapshot
                requests it made in --seconds and the waits between them, its peak RSS
    prepare     `idletrain data prepare` (--tokenizer bytes) of a .jsonl whose one line is --record-mb
                MB, at the default record limit and at 512 MiB: exit status, seconds, peak RSS

Peak RSS is the child's own (os.wait4's rusage), so each row is its process alone. Times depend on
the machine; the bytes and the memory do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from shared import protocol
from shared.config import CompressionConfig, InnerConfig
from shared.model import ModelConfig

ANSWER_BYTES = 3 << 30
MODEL = ModelConfig(n_layer=1, d_model=32, n_head=2, context=32)  # 23,008 parameters
WORDS = "the quick brown fox jumps over the lazy dog while idle machines train small models together "


@dataclasses.dataclass
class Row:
    what: str
    read_bytes: int | None
    requests: int | None
    gaps_s: list[float]
    rc: int | None
    seconds: float
    peak_rss: int


def _run(cmd: list[str], *, timeout_s: float) -> tuple[int, str, int, float]:
    """(exit status, its output, its peak RSS in bytes, seconds) of one child process."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(timeout_s, p.kill)
        timer.start()
        _, status, usage = os.wait4(p.pid, 0)
        timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        return p.returncode, out.read(), usage.ru_maxrss * 1024, time.monotonic() - t0


class _Flooding(http.server.ThreadingHTTPServer):
    """A coordinator: /healthz, a lease of the test model whenever asked, releases, and 3 GiB of
    zeros (behind zstd's magic) for every snapshot."""

    def __init__(self, *, chunked: bool) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.chunked, self.snapshots, self.leases = chunked, [], 0


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Flooding

    def log_message(self, *args) -> None:
        pass

    def _json(self, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        if self.path == "/healthz":
            return self._json({"status": "ok", "api_version": 4, "min_api_version": 2})
        self.server.snapshots.append(time.monotonic())
        self.send_response(200)
        self.send_header("Transfer-Encoding" if self.server.chunked else "Content-Length",
                         "chunked" if self.server.chunked else str(ANSWER_BYTES))
        self.send_header("X-Content-SHA256", "0" * 64)
        self.send_header("X-Model-Version", "4")
        self.end_headers()
        chunk = b"\x28\xb5\x2f\xfd" + bytes((1 << 20) - 4)
        try:
            for _ in range(ANSWER_BYTES >> 20):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if self.server.chunked else chunk)
        except OSError:  # the worker hung up: what it wanted
            pass
        self.close_connection = True

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.leases += 1
        self._json(protocol.Lease(
            lease_id=self.server.leases, run="t", shard_id=1, shard_sha256="0" * 64, base_version=4, seed=9, lr=3e-3,
            inner=InnerConfig(steps=6, batch_size=2), compression=CompressionConfig(), model=MODEL.to_dict(),
            deadline=datetime.now(UTC) + timedelta(hours=1)).model_dump(mode="json"))

    def do_DELETE(self) -> None:  # noqa: N802
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()


_WORKER = """
import sys, tempfile, threading
from worker.loop import Worker
from worker.settings import WorkerSettings
w = Worker(WorkerSettings(coordinator=sys.argv[1], run="t", token="x", state_dir=tempfile.mkdtemp(), device="cpu"))
threading.Timer(float(sys.argv[2]), w.stop.event.set).start()
w.run()
print("received", w.client.received_bytes)
"""


def worker_row(*, chunked: bool, seconds: float) -> Row:
    server = _Flooding(chunked=chunked)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        rc, out, rss, took = _run([sys.executable, "-c", _WORKER, url, str(seconds)], timeout_s=seconds + 600)
    finally:
        server.shutdown()
    received = [int(line.split()[1]) for line in out.splitlines() if line.startswith("received ")]
    times = server.snapshots
    return Row("worker, 3 GiB answers" + (" (chunked)" if chunked else " (Content-Length)"),
               received[0] if received else None, len(times), [round(b - a, 1) for a, b in zip(times, times[1:])],
               rc, took, rss)


def prepare_rows(record_mb: int, folder: Path) -> list[Row]:
    source = folder / "one-line.jsonl"
    with open(source, "w") as f:
        f.write('{"text": "')
        left = record_mb * 10**6
        while left > 0:
            f.write((WORDS * 10_000)[:left])
            left -= len(WORDS) * 10_000
        f.write('"}\n')
    rows = []
    for limit in (None, "512MiB"):
        out = folder / f"out-{limit}"
        cmd = [sys.executable, "-m", "idletrain", "data", "prepare", str(source), "--out", str(out), "--tokenizer",
               "bytes", "--quiet", *(["--max-record-bytes", limit] if limit else [])]
        rc, _, rss, took = _run(cmd, timeout_s=3600)
        rows.append(Row(f"data prepare, one {record_mb} MB line, limit {limit or '64MiB (default)'}", None, None, [],
                        rc, took, rss))
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| case | bytes the worker read | snapshot requests | waits between them (s) | exit | seconds | peak RSS |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        read = f"{r.read_bytes:,}" if r.read_bytes is not None else ""
        gaps = ", ".join(f"{g:g}" for g in r.gaps_s)
        lines.append(f"| {r.what} | {read} | {r.requests if r.requests is not None else ''} | {gaps} | {r.rc} | "
                     f"{r.seconds:.0f} | {r.peak_rss / 1e6:,.0f} MB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long each worker row runs (default 60)")
    p.add_argument("--record-mb", type=int, default=300, help="the one .jsonl line's size in MB (default 300)")
    args = p.parse_args(argv)
    rows = [worker_row(chunked=False, seconds=args.seconds), worker_row(chunked=True, seconds=args.seconds)]
    with tempfile.TemporaryDirectory() as folder:
        rows += prepare_rows(args.record_mb, Path(folder))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
