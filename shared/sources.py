"""The texts of a corpus on disk, streamed: a text file, a folder, a .jsonl or a .parquet file.

`pieces(source)` yields `Piece`s: a document's text in order, at most about PIECE_BYTES each (a long
file is cut at a line end, or at a character boundary when a line is longer), `last` on a document's
final piece. A text file streams whatever its size: nothing holds more than one piece and one read
buffer. A record (a .jsonl line, its JSON and all; a .parquet value) is read whole, so it may be at
most `max_record_bytes` (MAX_RECORD_BYTES, 64 MiB, by default): a long .jsonl line is measured
first, in pieces that are not kept, and one over the limit stops the reading with its line (a
.parquet value with its row) without being read into memory. Memory then stays within about twice
the largest record (its bytes and its text, then its text and the parsed record), whatever the
file holds; a .parquet file's also holds a row group's text column, which pyarrow reads whole.

Bad input raises `SourceError` naming the file and what to do: a file that cannot be read, invalid
UTF-8 (with its byte offset; `errors="replace"` reads on), a .jsonl line that is not a JSON object
or lacks the text field (with its line number), a record over `max_record_bytes`, an empty text
(`skip_empty` skips it), a .parquet without the column. .parquet needs pyarrow
(`pip install 'idletrain[data]'`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

from shared.extras import MissingExtra, require

PIECE_BYTES = 1 << 18
MAX_RECORD_BYTES = 64 << 20  # a record read whole: books and source files are far smaller, a dump of one is not
PARQUET_BATCH_BYTES = 16 << 20  # about this much text column converted at a time
LINE_READ_BYTES = 1 << 20  # a .jsonl line is read in pieces of this
TEXT_SUFFIXES = frozenset((".txt", ".md", ".rst", ".py", ".text", ".tex", ".html", ".htm", ".xml", ".csv",
                           ".tsv", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java", ".js", ".ts",
                           ".sh", ".toml", ".yaml", ".yml", ".ini", ".cfg", ".org", ".adoc"))
JSONL_SUFFIXES = frozenset((".jsonl", ".ndjson"))
PARQUET_SUFFIXES = frozenset((".parquet",))
Errors = Literal["strict", "replace"]


class SourceError(ValueError):
    """Input that cannot be read as asked; the message names the file and what to do."""


@dataclasses.dataclass(frozen=True)
class Piece:
    text: str
    last: bool  # the end of a document: a separator follows it
    n_bytes: int  # UTF-8 bytes of `text`


@dataclasses.dataclass(frozen=True)
class Options:
    text_field: str = "text"
    errors: Errors = "strict"
    skip_empty: bool = False
    max_record_bytes: int = MAX_RECORD_BYTES

    def __post_init__(self) -> None:
        if self.max_record_bytes < 1:
            raise SourceError(f"--max-record-bytes must be at least 1 byte, got {self.max_record_bytes}")


def kind_of(path: Path) -> str:
    """text | folder | jsonl | parquet, by what `path` is; SourceError when it is none of them."""
    if path.is_dir():
        return "folder"
    if not path.exists():
        raise SourceError(f"{str(path)!r} does not exist: give a text file, a folder, a .jsonl or a .parquet file")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    return "text"


def folder_files(root: Path) -> list[Path]:
    """The files a folder contributes, in a fixed order (by the SHA-256 of the relative path, as
    shared/data.py): text, .jsonl and .parquet files; a symlink out of the folder is skipped."""
    real = root.resolve()
    known = TEXT_SUFFIXES | JSONL_SUFFIXES | PARQUET_SUFFIXES
    files = [p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in known
             and p.resolve().is_relative_to(real)]
    return sorted(files, key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).digest())


def _decode(raw: bytes, path: Path, offset: int, errors: Errors) -> str:
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path}: invalid UTF-8 at byte offset {offset + exc.start} ({exc.reason}): convert the "
                          "file to UTF-8, or pass --errors replace to read such bytes as U+FFFD") from None


def _cut(buf: bytes) -> int:
    """Where to end a piece in `buf` (longer than PIECE_BYTES): after its last line end, else at a
    UTF-8 character boundary (never inside a multi-byte character)."""
    nl = buf.rfind(b"\n", 0, PIECE_BYTES)
    if nl >= 0:
        return nl + 1
    cut = PIECE_BYTES
    while cut > 0 and buf[cut] & 0xC0 == 0x80:  # a continuation byte: the character started before
        cut -= 1
    return cut or PIECE_BYTES


def _open(path: Path, mode: str = "rb"):
    try:
        return open(path, mode)
    except OSError as exc:
        raise SourceError(f"{path} cannot be read ({exc.strerror or exc}): check that it exists and that this "
                          "user may read it") from None


def text_pieces(path: Path, opts: Options) -> Iterator[Piece]:
    """A text file as one document, in pieces."""
    offset, buf, any_text = 0, b"", False
    with _open(path) as f:
        while True:
            try:
                chunk = f.read(PIECE_BYTES)
            except OSError as exc:
                raise SourceError(f"{path} cannot be read at byte {offset + len(buf)} ({exc})") from None
            buf += chunk
            while len(buf) > PIECE_BYTES or (not chunk and buf):
                cut = _cut(buf) if len(buf) > PIECE_BYTES else len(buf)
                raw, buf = buf[:cut], buf[cut:]
                last = not chunk and not buf
                any_text = True
                yield Piece(_decode(raw, path, offset, opts.errors), last, len(raw))
                offset += len(raw)
            if not chunk:
                break
    if not any_text and not opts.skip_empty:
        raise SourceError(f"{path} is empty: remove it from the corpus, or pass --skip-empty")


def _text_of(value, where: str, opts: Options, fields: Iterable[str] | None = None) -> str | None:
    """A record's text field: a non-empty string (None: skip it). `fields`: the record's field names,
    when the field is missing from it (named in the error)."""
    if fields is not None:
        names = ", ".join(repr(f) for f in list(fields)[:8]) or "none"
        raise SourceError(f"{where}: no field {opts.text_field!r} (its fields: {names}): name the text field with "
                          "--text-field")
    if not isinstance(value, str):
        kind = "null" if value is None else f"a {type(value).__name__}"
        raise SourceError(f"{where}: the field {opts.text_field!r} is {kind}, not a string: name the text field "
                          "with --text-field, or remove the record")
    if not value:
        if opts.skip_empty:
            return None
        raise SourceError(f"{where}: the field {opts.text_field!r} is empty: remove the record, or pass "
                          "--skip-empty")
    return value


def _too_long(where: str, opts: Options, n_bytes: int | None = None) -> SourceError:
    size = f" ({n_bytes:,} bytes)" if n_bytes is not None else ""
    return SourceError(f"{where}: the record{size} is over the limit of {opts.max_record_bytes:,} bytes a record "
                       "may have (each is read whole): raise it with --max-record-bytes (memory takes about twice "
                       "the largest record), or split the record")


def _content_bytes(line: bytes | bytearray) -> int:
    """A line's bytes without its line end ("\n" or "\r\n")."""
    return len(line) - (2 if line.endswith(b"\r\n") else 1 if line.endswith(b"\n") else 0)


def _read_line(f, limit: int) -> bytes | bytearray | None:
    """The next line of `f` (empty at the end), or None when it holds more than `limit` bytes before
    its line end. A long line is measured first, read ahead in pieces that are not kept, then read
    once into memory (a buffer grown piece by piece may take twice the line at a time); one too long
    is never read into memory."""
    line = f.readline(min(LINE_READ_BYTES, limit + 2))
    if len(line) < LINE_READ_BYTES or line.endswith(b"\n"):  # the whole line (or all there is)
        return line if _content_bytes(line) <= limit else None
    if not f.seekable():  # a pipe: the line is gathered as it comes
        line = bytearray(line)
        while len(line) < limit + 2 and not line.endswith(b"\n") and (part := f.readline(
                min(LINE_READ_BYTES, limit + 2 - len(line)))):
            line += part
        return line if _content_bytes(line) <= limit else None
    start, n, tail = f.tell() - len(line), len(line), line[-2:]
    while n < limit + 2 and not tail.endswith(b"\n") and (part := f.readline(min(LINE_READ_BYTES, limit + 2 - n))):
        n, tail = n + len(part), (tail + part)[-2:]
    if _content_bytes(tail) - len(tail) + n > limit:
        return None
    f.seek(start)
    return f.read(n)


def jsonl_pieces(path: Path, opts: Options) -> Iterator[Piece]:
    """One document per line: the line's JSON object's text field."""
    offset, number, records = 0, 0, 0
    with _open(path) as f:
        while (raw := _read_line(f, opts.max_record_bytes)) != b"":
            number += 1
            if raw is None:
                raise _too_long(f"{path}, line {number}", opts)
            start, offset = offset, offset + len(raw)
            line = _decode(raw, path, start, opts.errors)
            del raw  # two copies of a record at most: its bytes and its text, then its text and the record
            if not line or line.isspace():  # (strip() would copy the line)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:  # its own "line 1 column 9" would name another line
                raise SourceError(f"{path}, line {number}: not JSON ({exc.msg} at character {exc.pos + 1} of the "
                                  "line; a record cut short, or two on one line?): each line of a .jsonl file must "
                                  "be one JSON object") from None
            del line
            if not isinstance(record, dict):
                raise SourceError(f"{path}, line {number}: a JSON {type(record).__name__}, not an object with a "
                                  f"{opts.text_field!r} field")
            missing = None if opts.text_field in record else record.keys()
            text = _text_of(record.get(opts.text_field), f"{path}, line {number}", opts, missing)
            del record
            records += 1
            if text is not None:
                yield from _split(text)
    if not records and not opts.skip_empty:
        raise SourceError(f"{path} is empty (no JSON record in it): remove it from the corpus, or pass --skip-empty")


def _split(text: str) -> Iterator[Piece]:
    """A document in memory as pieces of at most about PIECE_BYTES characters."""
    for i in range(0, len(text), PIECE_BYTES):
        part = text[i:i + PIECE_BYTES]
        yield Piece(part, i + PIECE_BYTES >= len(text), len(part.encode("utf-8", errors="surrogatepass")))


def parquet_pieces(path: Path, opts: Options) -> Iterator[Piece]:
    """One document per row: the text column's value, read a batch of rows at a time."""
    try:
        pq = require("pyarrow.parquet", "data", purpose="reading .parquet")
    except MissingExtra as exc:
        raise SourceError(f"{path}: {exc}") from None
    try:
        pf = pq.ParquetFile(path)
    except OSError as exc:
        raise SourceError(f"{path} cannot be read as parquet ({exc}): check the file") from None
    except Exception as exc:  # pyarrow.ArrowInvalid and friends: not a parquet file
        raise SourceError(f"{path} is not a parquet file ({exc})") from None
    names = pf.schema_arrow.names
    if opts.text_field not in names:
        raise SourceError(f"{path} has no column {opts.text_field!r} (it has {', '.join(names)}): name the text "
                          "column with --text-field")
    pa, pc = require("pyarrow", "data"), require("pyarrow.compute", "data")
    row = 0
    for batch in pf.iter_batches(batch_size=_batch_rows(pf.metadata, opts.text_field), columns=[opts.text_field]):
        column = batch.column(0)
        strings = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
        sizes = pc.binary_length(column).to_pylist() if strings else [None] * len(column)
        for i in range(len(column)):
            row += 1
            if sizes[i] is not None and sizes[i] > opts.max_record_bytes:  # known before the text is made
                raise _too_long(f"{path}, row {row}", opts, sizes[i])
            text = _text_of(column[i].as_py(), f"{path}, row {row}", opts)
            if text is not None:
                yield from _split(text)


def _batch_rows(meta, column: str) -> int:
    """Rows converted at a time: about PARQUET_BATCH_BYTES of the text column by the row groups'
    sizes, 1 to 1024. (pyarrow reads a row group's column whole all the same.)"""
    per_row = 1
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        for j in range(group.num_columns):
            if group.column(j).path_in_schema == column and group.num_rows:
                per_row = max(per_row, group.column(j).total_uncompressed_size // group.num_rows)
    return max(1, min(1024, PARQUET_BATCH_BYTES // per_row))


READERS = {"text": text_pieces, "jsonl": jsonl_pieces, "parquet": parquet_pieces}


def pieces(source: Path, opts: Options = Options()) -> Iterator[Piece]:
    """Every piece of every document of `source`, in order."""
    kind = kind_of(source)
    files = folder_files(source) if kind == "folder" else [source]
    if kind == "folder" and not files:
        raise SourceError(f"folder {source} holds no text, .jsonl or .parquet files (text: "
                          f"{', '.join(sorted(TEXT_SUFFIXES)[:8])}, …)")
    for path in files:
        yield from READERS[kind_of(path)](path, opts)
