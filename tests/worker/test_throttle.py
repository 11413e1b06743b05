"""worker.throttle and the client's use of it: token buckets on a fake clock, paced uploads and
downloads through httpx.MockTransport, and the daily transfer cap kept across restarts."""

from __future__ import annotations

import hashlib
import json
import threading
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from shared import protocol
from worker.client import CoordinatorClient, IntegrityError
from worker.throttle import DailyTransfer, TokenBucket, kbps_to_bytes_per_s, paced


class FakeTime:
    """A clock that moves only when slept on."""

    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def test_kbps_are_kilobits():
    assert kbps_to_bytes_per_s(1000) == 125_000
    assert kbps_to_bytes_per_s(8) == 1000


def test_bucket_lets_a_burst_through_then_holds_the_rate():
    ft = FakeTime()
    bucket = TokenBucket(10_000, burst_bytes=5_000, clock=ft.clock, sleep=ft.sleep)
    assert bucket.take(5_000) == 0  # the burst is free
    for _ in range(10):
        bucket.take(1_000)
    assert ft.t == pytest.approx(1.0)  # 10,000 more bytes at 10,000 B/s
    ft.t += 100  # idle time refills at most one burst
    assert bucket.take(5_000) == 0
    assert bucket.take(5_000) == pytest.approx(0.5)


def test_bucket_passes_a_chunk_larger_than_its_burst_at_the_rate():
    ft = FakeTime()
    bucket = TokenBucket(1_000, burst_bytes=100, clock=ft.clock, sleep=ft.sleep)
    assert bucket.take(2_100) == pytest.approx(2.0)


def test_bucket_rejects_a_zero_rate():
    with pytest.raises(ValueError):
        TokenBucket(0)


@pytest.mark.parametrize("size", [0, 1, 4096, 100_000])
def test_paced_body_is_the_body(size):
    ft = FakeTime()
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    counted = []
    bucket = TokenBucket(20_000, clock=ft.clock, sleep=ft.sleep)
    assert b"".join(paced(body, bucket, count=counted.append)) == body
    assert sum(counted) == size
    assert ft.t == pytest.approx(max(0, size - bucket.burst) / 20_000)


def paced_client(handler, ft: FakeTime, *, up: float | None = None, down: float | None = None,
                 **kw) -> tuple[CoordinatorClient, list[int]]:
    metered: list[int] = []
    c = CoordinatorClient("http://coordinator.test", transport=httpx.MockTransport(handler), **kw)
    c.set_transfer(upload_bytes_per_s=up, download_bytes_per_s=down, meter=metered.append)
    if c.upload_bucket is not None:
        c.upload_bucket = TokenBucket(up, burst_bytes=4096, clock=ft.clock, sleep=ft.sleep)
    if c.download_bucket is not None:
        c.download_bucket = TokenBucket(down, burst_bytes=4096, clock=ft.clock, sleep=ft.sleep)
    return c, metered


def test_upload_is_paced_and_sent_whole_with_a_content_length():
    ft = FakeTime()
    seen = {}
    body = b"\x01" * 100_000

    def handler(request: httpx.Request) -> httpx.Response:
        seen["length"] = request.headers.get("content-length")
        seen["chunked"] = request.headers.get("transfer-encoding")
        seen["body"] = request.read()
        return httpx.Response(202, json={"lease_id": 3, "delta_id": 1, "will_merge_into": 2})

    c, metered = paced_client(handler, ft, up=10_000)
    ack = c.upload_delta(3, body)
    assert ack.will_merge_into == 2
    assert seen == {"length": "100000", "chunked": None, "body": body}
    assert ft.t == pytest.approx((100_000 - 4096) / 10_000)  # 100 KB at 10 KB/s, less the first burst
    assert c.bytes_up == c.sent_bytes == 100_000
    assert sum(metered) == c.sent_bytes + c.received_bytes


def test_download_is_paced_and_counted():
    ft = FakeTime()
    blob = b"z" * 50_000

    def handler(request):
        return httpx.Response(200, content=blob, headers={protocol.H_SHA256: hashlib.sha256(blob).hexdigest(),
                                                          protocol.H_VERSION: "4"})

    c, metered = paced_client(handler, ft, down=25_000)
    assert c.snapshot("t", 4) == (blob, 4)
    assert ft.t == pytest.approx((50_000 - 4096) / 25_000)
    assert c.received_bytes == c.bytes_down == 50_000 and sum(metered) == 50_000


def test_without_limits_nothing_sleeps_but_everything_is_counted():
    ft = FakeTime()
    c, metered = paced_client(lambda r: httpx.Response(200, json={"status": "ok", "api_version": 1}), ft)
    c.health()
    assert ft.slept == [] and c.upload_bucket is None and c.download_bucket is None
    assert sum(metered) == c.received_bytes > 0


def test_the_download_cap_stops_reading_midway():
    reads = []

    def stream():
        for _ in range(100):
            reads.append(1)
            yield b"y" * 1000

    c = CoordinatorClient("http://c.test", max_download_bytes=5_000,
                          transport=httpx.MockTransport(lambda r: httpx.Response(200, content=stream())))
    with pytest.raises(IntegrityError, match="cap"):
        c.health()
    assert len(reads) < 10  # it did not read the 100 KB first


# -- the daily cap ----------------------------------------------------------------------------------

class Day:
    def __init__(self) -> None:
        self.now = datetime(2025, 5, 1, 22, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def test_daily_transfer_survives_a_restart_and_resets_at_midnight_utc(tmp_path):
    day = Day()
    path = tmp_path / "transfer.json"
    t1 = DailyTransfer(path, cap_bytes=1_000_000, now=day, flush_bytes=10**9, flush_s=10**9)
    t1.add(600_000)
    assert t1.used_today() == 600_000 and not t1.reached()
    assert t1.reached(extra_bytes=400_000)  # the next round would cross it
    t1.close()
    assert json.loads(path.read_text()) == {"format": 1, "day": "2025-05-01", "bytes": 600_000}
    # a restart: the count goes on from the file
    t2 = DailyTransfer(path, cap_bytes=1_000_000, now=day)
    assert t2.used_today() == 600_000
    t2.add(500_000)
    assert t2.reached()
    t2.close()
    assert DailyTransfer(path, cap_bytes=1_000_000, now=day).reached()
    # the next UTC day starts from zero, in memory and for a restart
    day.now += timedelta(hours=2, minutes=1)
    assert t2.used_today() == 0 and not t2.reached()
    assert DailyTransfer(path, cap_bytes=1_000_000, now=day).used_today() == 0
    t2.add(10)
    t2.close()
    assert json.loads(path.read_text())["day"] == "2025-05-02"


def test_daily_transfer_flushes_by_size_and_time(tmp_path):
    path = tmp_path / "transfer.json"
    ticks = [0.0]
    t = DailyTransfer(path, cap_bytes=None, clock=lambda: ticks[0], flush_bytes=1000, flush_s=5)
    t.add(999)
    assert not path.exists()
    t.add(1)
    assert json.loads(path.read_text())["bytes"] == 1000
    t.add(5)
    ticks[0] = 6.0
    t.add(5)
    assert json.loads(path.read_text())["bytes"] == 1010
    assert not t.reached()  # no cap: never reached


def test_two_processes_sharing_a_state_dir_share_one_budget(tmp_path):
    path = tmp_path / "transfer.json"
    a = DailyTransfer(path, cap_bytes=10_000, flush_bytes=1)
    b = DailyTransfer(path, cap_bytes=10_000, flush_bytes=1)
    threads = [threading.Thread(target=lambda x=x: [x.add(10) for _ in range(200)]) for x in (a, b)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    a.flush()
    b.flush()
    assert json.loads(path.read_text())["bytes"] == 4000
    assert a.used_today() == b.used_today() == 4000


def test_a_corrupt_count_starts_the_day_at_zero(tmp_path, caplog):
    path = tmp_path / "transfer.json"
    path.write_text("{not json")
    t = DailyTransfer(path, cap_bytes=100)
    assert t.used_today() == 0
    assert "unreadable" in caplog.text
