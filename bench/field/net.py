"""The field's network and CPU: one network namespace per machine, links shaped with `tc`, an equal CPU
share for every process that trains.

    switch      namespace PREFIXsw holds a bridge; every machine's veth pair ends on it
    coordinator namespace PREFIXc, address 10.231.0.1, its link shaped to `coord_mbit` each way
    worker i    namespace PREFIXwI, address 10.231.0.(10+i), its uplink shaped to `up_mbit` (tbf on its
                own end of the veth) and its downlink to `down_mbit` (tbf on the switch's end)

Nothing is addressed outside the namespaces the field creates; `close()` deletes them (the veths go
with them). Latency: this kernel has no netem, and the field adds none: every row, data-parallel
included, sees the links' bandwidth and the kernel's own sub-millisecond latency, which favours the
rows that talk every step (docs/benchmarks/field says so beside the numbers).

Bytes are the interfaces' own counters (`ip -s link`): what crossed the wire, headers, retransmits and
TCP acknowledgements included.

CPU: each process that trains runs in a cgroup (v1 `cpu` controller) capped at `cpu_share` of one core
(cfs quota), so a worker of any row computes at the same speed whatever else runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

SUBNET = "10.231.0"
COORD_ADDR = f"{SUBNET}.1"
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
CFS_PERIOD_US = 100_000


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _tc(ns: str, dev: str, mbit: float) -> None:
    # tbf: rate, a bucket of at least 64 KiB (GSO segments fit; ~5 ms at the rate otherwise) and a queue
    # of 100 ms at the rate (TCP sees a bottleneck of that depth, as behind a home router)
    rate_bytes = mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bytes * 0.005))
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                    "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "100ms"],
                   check=True, capture_output=True, text=True)


def available() -> str | None:
    """None when this machine can build a field, else why not (for a skip or a CLI message)."""
    if os.geteuid() != 0:
        return "the field needs root: network namespaces, tc and cgroups"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the field needs {tool!r} (Debian: apt-get install iproute2)"
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        return f"the field caps CPU through the cgroup v1 cpu controller, not mounted at {CGROUP_CPU}"
    return None


@dataclasses.dataclass(frozen=True)
class Counters:
    """One interface's bytes, as the kernel counted them."""

    tx: int
    rx: int

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.tx - other.tx, self.rx - other.rx)


class Field:
    """The namespaces, links and cgroups of one benchmark (see the module docstring); a context manager."""

    def __init__(self, workers: int, *, up_mbit: float = 10, down_mbit: float = 50, coord_mbit: float = 1000,
                 cpu_share: float = 0.15, prefix: str | None = None) -> None:
        if not 1 <= workers <= 200:
            raise ValueError("a field has 1 to 200 workers")
        if not 0 < cpu_share <= os.cpu_count():
            raise ValueError(f"cpu_share must be in (0, {os.cpu_count()}]")
        self.workers, self.up_mbit, self.down_mbit, self.coord_mbit = workers, up_mbit, down_mbit, coord_mbit
        self.cpu_share = cpu_share
        self.prefix = prefix or f"itf{os.getpid() % 100000}"
        self.cgroup = CGROUP_CPU / f"idletrain-{self.prefix}"
        self._made: list[str] = []

    # -- names ----------------------------------------------------------------------------------

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    @property
    def coord(self) -> str:
        return f"{self.prefix}c"

    def worker(self, i: int) -> str:
        return f"{self.prefix}w{i}"

    @staticmethod
    def worker_addr(i: int) -> str:
        return f"{SUBNET}.{10 + i}"

    # -- building and removing ------------------------------------------------------------------

    def __enter__(self) -> Field:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _plug(self, ns: str, port: str, addr: str, *, up_mbit: float, down_mbit: float) -> None:
        """A veth from namespace `ns` (eth0, `addr`) to the switch's bridge (port `port`)."""
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _tc(ns, "eth0", up_mbit)  # what leaves the machine: its uplink
        _tc(self.switch, port, down_mbit)  # what the switch sends it: its downlink

    def build(self) -> None:
        self._netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        self._netns(self.coord)
        self._plug(self.coord, "c", COORD_ADDR, up_mbit=self.coord_mbit, down_mbit=self.coord_mbit)
        for i in range(self.workers):
            self._netns(self.worker(i))
            self._plug(self.worker(i), f"w{i}", self.worker_addr(i), up_mbit=self.up_mbit, down_mbit=self.down_mbit)
        self.cgroup.mkdir(exist_ok=True)

    def close(self) -> None:
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()
        if self.cgroup.exists():
            for child in self.cgroup.iterdir():
                if child.is_dir():
                    _kill_cgroup(child)
                    child.rmdir()
            _kill_cgroup(self.cgroup)
            self.cgroup.rmdir()

    @contextlib.contextmanager
    def free_links(self):
        """The workers' links unshaped for a while (the ideal: data-parallel as on a datacenter's links),
        then shaped again."""
        for i in range(self.workers):
            for ns, dev in ((self.worker(i), "eth0"), (self.switch, f"w{i}")):
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                               capture_output=True)
        try:
            yield
        finally:
            for i in range(self.workers):
                _tc(self.worker(i), "eth0", self.up_mbit)
                _tc(self.switch, f"w{i}", self.down_mbit)

    # -- running --------------------------------------------------------------------------------

    def command(self, ns: str, argv: list[str], *, cpu: str | None = None, share: float | None = None) -> list[str]:
        """`argv` run in namespace `ns`; with `cpu`, in a cgroup of that name capped at `share` (default the
        field's cpu_share) of a core, which its children inherit."""
        inner = ["ip", "netns", "exec", ns, *argv]
        if cpu is None:
            return inner
        group = self.cgroup / cpu
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(int(CFS_PERIOD_US * (share or self.cpu_share))))
        return ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *inner]

    def counters(self, ns: str) -> Counters:
        out = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", "eth0"], check=True, capture_output=True,
                             text=True).stdout
        stats = json.loads(out)[0]["stats64"]
        return Counters(tx=int(stats["tx"]["bytes"]), rx=int(stats["rx"]["bytes"]))

    def throttled_s(self, cpu: str) -> float:
        """Seconds the cgroup `cpu` was held back at its cap (cpu.stat): > 0 means the cap bound it."""
        try:
            stat = dict(line.split() for line in (self.cgroup / cpu / "cpu.stat").read_text().splitlines())
        except OSError:
            return 0.0
        return int(stat.get("throttled_time", 0)) / 1e9


def _kill_cgroup(group: Path) -> None:
    try:
        pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    # the kernel moves a dead process out of its cgroup once reaped; wait briefly for that
    for _ in range(100):
        if not (group / "cgroup.procs").read_text().split():
            return
        time.sleep(0.05)
