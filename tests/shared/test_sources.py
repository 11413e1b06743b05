"""shared/sources.py's record limit (issue 34, item 8): a .jsonl line or a .parquet value is read
whole, so it may be at most max_record_bytes; a longer one stops the reading with its line or row,
without being read into memory, and memory stays within about twice the largest record read."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from shared import sources
from shared.dataset import prepare
from shared.sources import Options, SourceError
from tests.conftest import peak_bytes

DEFAULT_LIMIT = 64 << 20  # sources.MAX_RECORD_BYTES
WORDS = "the quick brown fox jumps over the lazy dog while idle machines train small models "


def _record(n_bytes: int) -> bytes:
    """A JSON line (without its line end) of exactly n_bytes: {"text": "..."}."""
    head, tail = b'{"text": "', b'"}'
    body = (WORDS.encode() * (n_bytes // len(WORDS) + 1))[: n_bytes - len(head) - len(tail)]
    return head + body + tail


def _texts(path: Path, opts: Options) -> list[str]:
    out, doc = [], ""
    for piece in sources.pieces(path, opts):
        doc += piece.text
        if piece.last:
            out.append(doc)
            doc = ""
    return out


def test_a_jsonl_line_over_the_record_limit_is_refused_without_being_read(tmp_path):
    """The attack: one line of 64 MiB and 2 MB more. It was read and parsed whole (three copies of it
    at once); now the reading stops at it, naming the line, the limit and the flag that raises it."""
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write(_record(100) + b"\n" + _record(DEFAULT_LIMIT + 2_000_000) + b"\n" + _record(100) + b"\n")

    def run() -> None:
        with pytest.raises(SourceError, match=rf"big.jsonl, line 2: the record is over the limit of "
                                              rf"{DEFAULT_LIMIT:,} bytes .*--max-record-bytes"):
            prepare(path, tmp_path / "out", tokenizer="bytes", shard_tokens=1024)

    peak = peak_bytes(run)
    assert peak < 16 << 20, f"peak {peak / 2**20:.1f} MiB"  # a few read buffers, never the line
    assert not (tmp_path / "out").exists() and sources.MAX_RECORD_BYTES == DEFAULT_LIMIT


@pytest.mark.parametrize("read_bytes", [None, 7], ids=["one read", "pieces"])
@pytest.mark.parametrize("end", [b"\n", b"\r\n", b""], ids=["lf", "crlf", "eof"])
def test_a_record_of_the_limit_is_read_and_one_byte_more_is_refused(tmp_path, monkeypatch, read_bytes, end):
    if read_bytes is not None:
        monkeypatch.setattr(sources, "LINE_READ_BYTES", read_bytes)
    opts = Options(max_record_bytes=300)
    ok = tmp_path / "ok.jsonl"
    ok.write_bytes(_record(50) + b"\n" + _record(300) + end)
    assert [len(t) for t in _texts(ok, opts)] == [38, 288]  # the records less their JSON
    over = tmp_path / "over.jsonl"
    over.write_bytes(_record(50) + b"\n" + _record(301) + end + _record(50) + b"\n")
    with pytest.raises(SourceError, match=r"over.jsonl, line 2: the record is over the limit of 300 bytes"):
        _texts(over, opts)


def test_a_pipe_is_read_with_the_same_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "LINE_READ_BYTES", 16)  # lines longer than a read, gathered as they come
    fifo = tmp_path / "stream.jsonl"
    os.mkfifo(fifo)
    lines = _record(200) + b"\n" + _record(250) + b"\n" + _record(400) + b"\n"
    writer = threading.Thread(target=lambda: fifo.write_bytes(lines), daemon=True)
    writer.start()
    with pytest.raises(SourceError, match="line 3: the record is over the limit of 300 bytes"):
        _texts(fifo, Options(max_record_bytes=300))
    writer.join(10)


def test_memory_stays_within_twice_the_largest_record(tmp_path):
    path = tmp_path / "d.jsonl"
    record = _record(8 << 20)
    path.write_bytes(b"\n".join([_record(1000), record, _record(1000)]) + b"\n")
    peak = peak_bytes(lambda: sum(p.n_bytes for p in sources.pieces(path, Options(max_record_bytes=9 << 20))))
    assert peak < 2.2 * len(record), f"peak {peak / 2**20:.1f} MiB for a {len(record) / 2**20:.0f} MiB record"


def test_a_parquet_value_over_the_record_limit_is_refused_naming_its_row(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: pip install 'idletrain[test]'")
    import pyarrow.parquet as pq

    texts = [WORDS * 2] * 5 + [WORDS * 100] + [WORDS]
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet", row_group_size=4)
    with pytest.raises(SourceError, match=rf"d.parquet, row 6: the record \({len(WORDS) * 100:,} bytes\) is over "
                                          r"the limit of 1,000 bytes"):
        _texts(tmp_path / "d.parquet", Options(max_record_bytes=1000))
    assert _texts(tmp_path / "d.parquet", Options(max_record_bytes=len(WORDS) * 100)) == texts


def test_the_parquet_batch_follows_the_row_groups_sizes(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: pip install 'idletrain[test]'")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"n": [1, 2], "text": ["x" * (4 << 20), "y"]}), tmp_path / "d.parquet")
    assert 4 <= sources._batch_rows(pq.ParquetFile(tmp_path / "d.parquet").metadata, "text") <= 8  # 16 / 2 MiB a row
    pq.write_table(pa.table({"text": ["short"] * 5000}), tmp_path / "s.parquet")
    assert sources._batch_rows(pq.ParquetFile(tmp_path / "s.parquet").metadata, "text") == 1024


def test_the_cli_takes_the_limit_and_says_what_to_do(tmp_path, capsys):
    from idletrain.cli import main

    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": WORDS * n}) for n in (1, 30, 1)) + "\n")
    out = tmp_path / "out"
    assert main(["data", "prepare", str(tmp_path / "d.jsonl"), "--out", str(out), "--tokenizer", "bytes",
                 "--max-record-bytes", "1KB", "--shard-tokens", "1024", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "line 2: the record is over the limit of 1,000 bytes" in err and "--max-record-bytes" in err
    with pytest.raises(SystemExit):
        main(["data", "prepare", str(tmp_path / "d.jsonl"), "--out", str(out), "--max-record-bytes", "0"])
    assert "--max-record-bytes: '0' is not a size" in capsys.readouterr().err


def test_options_refuse_a_limit_below_one_byte():
    with pytest.raises(SourceError, match="--max-record-bytes must be at least 1 byte"):
        Options(max_record_bytes=0)
