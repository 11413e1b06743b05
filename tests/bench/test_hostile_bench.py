"""bench/hostile.py measures each case in its own process and prints what it measured."""

from __future__ import annotations

from bench import hostile


def test_prepare_rows_measure_each_limit_in_its_own_process(tmp_path):
    rows = hostile.prepare_rows(1, tmp_path)  # a 1 MB line: within both limits
    assert [r.rc for r in rows] == [0, 0]
    assert all(100e6 < r.peak_rss < 2e9 for r in rows)  # a Python with torch imported, not the bench's own
    table = hostile.table(rows)
    assert table.count("\n") == 3 and "one 1 MB line, limit 64MiB (default)" in table and "limit 512MiB" in table
